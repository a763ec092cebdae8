"""A second client process of a transport's store, for DP-MULTIPROCESS.

`python -m rlconform.conformance.clauses._peer SPEC` reads one pickled job on stdin:
`{"address": ..., "steps": [(op, args), ...], "result": path}`. It loads backend SPEC
(`load_backend`), reopens the store by its address (`backend.transport(address=...)`), runs
each step (`get`, `put`, `list`) and writes one pickled answer per step to `result`: ("ok",
...) or ("error", "ExcType: message"). Columns cross the process boundary as bytes
(served.pack_columns), so what is compared is what the store returned, not pickle's copy.
"""

from __future__ import annotations

import pickle
import sys


def main() -> int:
    spec = sys.argv[1]
    job = pickle.load(sys.stdin.buffer)
    from rlconform.conformance.backend import load_backend
    from rlconform.reference_impl.served import pack_columns, unpack_columns

    answers: list[tuple] = []
    try:
        transport = load_backend(spec).transport(address=job["address"])
    except Exception as exc:  # noqa: BLE001 - reported to the clause, which asserts on it
        answers.append(("error", f"reopening the store by its address: "
                                 f"{type(exc).__name__}: {exc}"))
    else:
        try:
            for op, args in job["steps"]:
                try:
                    if op == "get":
                        cols, tags = transport.get(*args)
                        answers.append(("ok", pack_columns(cols), tags))
                    elif op == "put":
                        partition, keys, packed, tags = args
                        transport.put(partition, keys, unpack_columns(packed), tags)
                        answers.append(("ok",))
                    elif op == "list":
                        answers.append(("ok", transport.list(*args)))
                    else:
                        answers.append(("error", f"unknown step {op!r}"))
                except Exception as exc:  # noqa: BLE001 - the clause judges it
                    answers.append(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            transport.close()
    with open(job["result"], "wb") as f:
        pickle.dump(answers, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
