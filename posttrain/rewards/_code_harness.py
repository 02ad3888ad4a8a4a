"""The code_tests harness, run inside posttrain.sandbox as the entry program (it imports nothing from posttrain).

It reads its spec from stdin before any model code runs ({"marker": str, "tests": source of a function
`__tests__(__plain__, __check__, *builtins)`, "builtins": [names]}), executes /sandbox/main.py (the
model's code) in a fresh namespace, then calls `__tests__` with genuine builtins and two functions of
its own: `__plain__(value)` returns a rebuilt copy of a value that is plain data (exactly None, bool,
int, float, str, bytes, list, tuple, set, frozenset, dict, or a generator / range / map / filter /
zip / enumerate of those) and raises otherwise, so no object the model built reaches a comparison;
functions and classes pass through unchanged (to be called: a call's result is checked again);
`__check__(i, values)` records the encoded operands of assert number i. It then writes one line,
marker + JSON of the records, and exits at once (`os._exit`: no atexit hook or thread of the model's
runs after it). The parent (posttrain/rewards/code.py) decodes the records and does the comparisons.
"""

import sys


def _main() -> None:
    import json
    import os
    import types

    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    marker, write, dumps, exit_now = spec["marker"], os.write, json.dumps, os._exit
    import builtins

    genuine = dict(builtins.__dict__)
    _type, _len, _list, _isinstance, _repr = type, len, list, isinstance, repr
    iters = (types.GeneratorType, range, map, filter, zip, enumerate, reversed)
    iter_types = tuple(_type(x) for x in (iter([]), iter(()), iter(""), iter({}), iter(set())))
    budget = [200_000]  # encoded items in all: a giant value is a failure, not a hang

    def encode(v, depth=0):
        budget[0] -= 1
        if budget[0] < 0 or depth > 50:
            raise ValueError("value too large or too deep")
        t = _type(v)
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if v == v and v not in (float("inf"), float("-inf")) else {"$float": _repr(v)}
        if t is bytes:
            return {"$bytes": v.hex()}
        if t is list:
            return [encode(x, depth + 1) for x in _list.__iter__(v)]
        if t is tuple:
            return {"$tuple": [encode(x, depth + 1) for x in tuple.__iter__(v)]}
        if t is set or t is frozenset:
            return {"$set": [encode(x, depth + 1) for x in t.__iter__(v)]}
        if t is dict:
            return {"$dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in dict.items(v)]}
        if t in iters or t in iter_types:
            return {"$list": [encode(x, depth + 1) for x in v]}
        raise TypeError(f"a {t.__name__} is not plain data (None, bool, int, float, str, bytes, list, tuple, "
                        "set, dict)")

    def decode(e):
        if _type(e) is list:
            return [decode(x) for x in e]
        if _type(e) is dict:
            (tag, x), = e.items()
            if tag == "$float":
                return float(x)
            if tag == "$bytes":
                return bytes.fromhex(x)
            if tag == "$list":
                return [decode(y) for y in x]
            if tag == "$tuple":
                return tuple(decode(y) for y in x)
            if tag == "$set":
                return frozenset(decode(y) for y in x)
            return {decode(k): decode(y) for k, y in x}
        return e

    records = []

    callables = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)

    def plain(v):
        if _type(v) in callables:  # passed on (HumanEval's check(candidate)); a record of one is refused
            return v
        return decode(encode(v))

    def check(i, values):
        records.append([i, [encode(v) for v in values]])

    def finish(error=None):
        line = marker + dumps({"records": records, "error": error}) + "\n"
        data = line.encode()
        while data:
            data = data[write(1, data):]
        exit_now(0)

    with open(os.path.join(os.path.dirname(sys.argv[2]), "main.py"), encoding="utf-8") as f:  # beside this file
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
        exec(compile(spec["tests"], "tests.py", "exec"), namespace)
        tests = namespace["__tests__"]
        tests(plain, check, *(genuine[n] for n in spec["builtins"]))
    except BaseException as exc:  # noqa: B036  (SystemExit too: the tests did not finish)
        finish(f"{_type(exc).__name__}: {str(exc)[:300]}")
    finish()


_main()
