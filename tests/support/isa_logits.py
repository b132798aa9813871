"""Logits of tiny models from one build of the library, for the cross-ISA test (tests/test_cross_isa.py).

Run as `KRAFLA_LIB=build/ISA/libkrafla.so python -m tests.support.isa_logits PLAN OUT`: PLAN is a
JSON list of {"key", "path", "ids", "kv", "batch", "pack"}; OUT gets an .npz with, per key, the
float32 logits after the prompt (evaluated `batch` tokens per step) followed by those of each of
three more tokens evaluated one at a time. A subprocess per library, because a process holds one
libkrafla.so (clib.load picks it from KRAFLA_LIB).
"""

import json
import sys

import numpy as np

from krafla_twisted.engine import clib
from krafla_twisted.engine.model import Model


def logits_of(path, ids, kv, batch, pack, threads):
    with Model(path, threads=threads, pack=pack) as model:
        session = model.session(ctx=len(ids) + 8, batch=batch, kv=kv)
        rows = [session.eval(np.asarray(ids[:-3], np.int32))]
        rows += [session.eval(np.asarray([token], np.int32)) for token in ids[-3:]]
        return np.stack(rows).astype(np.float32)


def main(plan_path, out_path):
    with open(plan_path) as f:
        plan = json.load(f)
    results = {"isa": np.array(clib.loaded_isa())}
    for item in plan:
        results[item["key"]] = logits_of(item["path"], item["ids"], item["kv"], item["batch"], item["pack"],
                                         item.get("threads", 1))
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
