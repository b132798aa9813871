"""One install, the best ISA at run time (krafla_twisted/engine/clib.py): the generic, avx2 and avx512
libraries are all built, the best one the CPU runs is loaded, KRAFLA_ISA overrides it with a
clear error for a name that is unknown or an ISA the CPU lacks, and the commands say which."""

import os
import subprocess
import sys

import pytest

from krafla_twisted.engine import clib

AVX2 = ("avx2", "fma", "f16c")
AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def cpuinfo_has(flag):
    """Whether /proc/cpuinfo's flags line names `flag` (read here without clib)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return flag in line.split(":", 1)[1].split()
    return False


def in_subprocess(code, **env):
    """Run python -c code with KRAFLA_LIB unset and env added: (status, stdout, stderr)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("KRAFLA_LIB", "KRAFLA_ISA")}
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    return done.returncode, done.stdout.strip(), done.stderr


LOADED = "from krafla_twisted.engine import clib; print(clib.loaded_isa())"


class ChoiceTests:
    """cpu_isa and check_isa on given flag sets."""

    @pytest.mark.parametrize("flags, isa", [
        (AVX512 + ("sse4_2",), "avx512"),
        (AVX2 + ("avx512f", "avx512bw", "avx512vl"), "avx2"),      # no VNNI: not the avx512 build
        (tuple(f for f in AVX512 if f != "avx512bw"), "avx2"),
        (("avx2", "fma"), "generic"),                               # no F16C
        ((), "generic"),
    ])
    def test_best_isa_of_flags(self, flags, isa):
        """The best ISA is the first whose every required flag is present."""
        assert clib.cpu_isa(flags) == isa

    def test_this_cpu(self):
        """On this machine: avx512 exactly when /proc/cpuinfo has AVX-512 F/BW/VL/VNNI and AVX2."""
        if all(cpuinfo_has(flag) for flag in AVX512):
            assert clib.cpu_isa() == "avx512"
        elif all(cpuinfo_has(flag) for flag in AVX2):
            assert clib.cpu_isa() == "avx2"
        else:
            assert clib.cpu_isa() == "generic"

    def test_unknown_and_missing(self):
        """An unknown name lists the known ones; an ISA the CPU lacks names the missing flags and
        the best it runs."""
        with pytest.raises(clib.KraflaError, match=r"KRAFLA_ISA='sse9' is not one of avx512, avx2, generic"):
            clib.check_isa("sse9")
        with pytest.raises(clib.KraflaError, match=r"KRAFLA_ISA=avx512: this CPU lacks avx512_vnni "
                                                   r"\(the best it runs is avx2\)"):
            clib.check_isa("avx512", AVX2 + ("avx512f", "avx512bw", "avx512vl"))
        clib.check_isa("generic", ())


class LoadTests:
    """Which library a fresh process loads (subprocesses: the choice is made once per process)."""

    def test_default_is_the_best_this_cpu_runs(self):
        """Without KRAFLA_ISA or KRAFLA_LIB, the loaded library's kr_isa() is cpu_isa()."""
        status, out, err = in_subprocess(LOADED)
        assert (status, out) == (0, clib.cpu_isa()), err

    def test_override_each_isa_the_cpu_runs(self):
        """KRAFLA_ISA=generic|avx2|avx512 loads that build (`make lib` built all three), for each
        the CPU runs."""
        runnable = [isa for isa in clib.ISA_FLAGS if all(cpuinfo_has(flag) for flag in clib.ISA_FLAGS[isa])]
        assert "generic" in runnable
        for isa in runnable:
            status, out, err = in_subprocess(LOADED, KRAFLA_ISA=isa)
            assert (status, out) == (0, isa), err

    def test_override_refused(self):
        """An unknown KRAFLA_ISA, or one the CPU lacks, is a KraflaError naming it."""
        status, out, err = in_subprocess(LOADED, KRAFLA_ISA="avx1024")
        assert status != 0 and "KRAFLA_ISA='avx1024' is not one of avx512, avx2, generic" in err
        if not cpuinfo_has("avx512_vnni"):
            status, out, err = in_subprocess(LOADED, KRAFLA_ISA="avx512")
            assert status != 0 and "this CPU lacks" in err and "avx512_vnni" in err

    def test_command_reports_the_refusal(self, tmp_path):
        """`krafla bench` with a bad KRAFLA_ISA prints one line naming it and exits 1, no traceback."""
        model = tmp_path / "model.mlb"
        model.write_bytes(b"")
        environment = {k: v for k, v in os.environ.items() if k not in ("KRAFLA_LIB", "KRAFLA_ISA")}
        done = subprocess.run([sys.executable, "-m", "krafla_twisted.cli.main", "bench", str(model)], capture_output=True,
                              text=True, env=dict(environment, KRAFLA_ISA="fast"))
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert "krafla bench: KRAFLA_ISA='fast' is not one of avx512, avx2, generic" in done.stderr

    def test_missing_best_falls_back(self, tmp_path, monkeypatch):
        """Without KRAFLA_ISA, a tree with only the avx2 and generic builds loads the best of those
        the CPU runs; asking for a build that is not there names where it was looked for."""
        for isa in ("avx2", "generic"):
            (tmp_path / "build" / isa).mkdir(parents=True)
            (tmp_path / "build" / isa / "libkrafla.so").write_bytes(b"")
        monkeypatch.setattr(clib, "SOURCE_ROOT", str(tmp_path))
        monkeypatch.setattr(clib, "PACKAGE_DIR", str(tmp_path / "package"))
        monkeypatch.delenv("KRAFLA_LIB", raising=False)
        monkeypatch.delenv("KRAFLA_ISA", raising=False)
        monkeypatch.setattr(clib, "cpu_flags", lambda: set(AVX512))
        assert clib.library_path() == str(tmp_path / "build" / "avx2" / "libkrafla.so")
        monkeypatch.setattr(clib, "cpu_flags", lambda: {"sse2"})
        assert clib.library_path() == str(tmp_path / "build" / "generic" / "libkrafla.so")
        monkeypatch.setattr(clib, "cpu_flags", lambda: set(AVX512))
        monkeypatch.setenv("KRAFLA_ISA", "avx512")
        with pytest.raises(clib.KraflaError, match="package/_native/avx512/libkrafla.so"):
            clib.library_path()

    def test_installed_package_layout(self, tmp_path, monkeypatch):
        """An installed package (no build tree) loads _native/<isa>/libkrafla.so, as setup.py puts
        the three libraries there."""
        monkeypatch.setattr(clib, "SOURCE_ROOT", str(tmp_path / "nowhere"))
        monkeypatch.setattr(clib, "PACKAGE_DIR", str(tmp_path))
        monkeypatch.delenv("KRAFLA_LIB", raising=False)
        monkeypatch.delenv("KRAFLA_ISA", raising=False)
        monkeypatch.setattr(clib, "cpu_flags", lambda: set(AVX512))
        for isa in clib.ISA_FLAGS:
            (tmp_path / "_native" / isa).mkdir(parents=True)
            (tmp_path / "_native" / isa / "libkrafla.so").write_bytes(b"")
        assert clib.library_path() == str(tmp_path / "_native" / "avx512" / "libkrafla.so")
        assert clib.library_path("generic") == str(tmp_path / "_native" / "generic" / "libkrafla.so")
