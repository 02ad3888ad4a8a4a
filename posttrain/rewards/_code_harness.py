"""The code_tests harness, run inside posttrain.sandbox as the entry program (it imports nothing from posttrain).

It executes /sandbox/main.py (the model's code) in a fresh namespace, then answers requests from the trainer, one
JSON line each on stdin, with one JSON line each on the reply descriptor ($POSTTRAIN_REPLY_FD, see
`Sandbox.drive`): {"op": "ready"} (None once the program has loaded), {"op": "name", "name": n} (a top-level name
of the program), {"op": "attr", "ref": i, "name": n} (an attribute of an object kept here) or
{"op": "call", "ref": i, "args": [...], "kwargs": {...}} (a call of one).
The answer is {"value": v} when the result is plain data (exactly None, bool, int, float, str, bytes, list, tuple,
set, frozenset, dict, or a generator / range / map / filter / zip / enumerate of those; encoded as in
posttrain/rewards/code.py), {"ref": i} for any other object (kept here: a function, a class, an instance), or
{"raised": type name, "message": text} when the program raised. It exits when stdin closes.

What it is not: a judge. It never sees the tests or an expected value: the trainer runs the tests, calls the
program's functions through these requests, and compares what comes back (posttrain/rewards/code.py). The program
shares this process and may rewrite any of it; all that can change is what its own functions answer.
"""

import sys


def _main() -> None:
    import builtins
    import json
    import os
    import types

    reply_fd = int(os.environ.pop("POSTTRAIN_REPLY_FD"))
    read, write, loads, dumps, exit_now = os.read, os.write, json.loads, json.dumps, os._exit
    _type, _repr, _str, _len = type, repr, str, len
    iters = (types.GeneratorType, range, map, filter, zip, enumerate, reversed)
    iter_types = tuple(_type(x) for x in (iter([]), iter(()), iter(""), iter({}), iter(set())))
    objects = []

    class NotPlain(Exception):
        pass

    def encode(v, budget, depth=0):
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
            return [encode(x, budget, depth + 1) for x in list.__iter__(v)]
        if t is tuple:
            return {"$tuple": [encode(x, budget, depth + 1) for x in tuple.__iter__(v)]}
        if t is set or t is frozenset:
            return {"$set": [encode(x, budget, depth + 1) for x in t.__iter__(v)]}
        if t is dict:
            return {"$dict": [[encode(k, budget, depth + 1), encode(x, budget, depth + 1)] for k, x in dict.items(v)]}
        if t in iters or t in iter_types:
            return {"$list": [encode(x, budget, depth + 1) for x in v]}
        raise NotPlain(t.__name__)

    def decode(e):
        if _type(e) is list:
            return [decode(x) for x in e]
        if _type(e) is dict:
            (tag, x), = e.items()
            if tag == "$ref":
                return objects[x]
            if tag == "$float":
                return float(x)
            if tag == "$bytes":
                return bytes.fromhex(x)
            if tag == "$list":
                return [decode(y) for y in x]
            if tag == "$tuple":
                return tuple(decode(y) for y in x)
            if tag == "$set":
                return set(decode(y) for y in x)
            return {decode(k): decode(y) for k, y in x}
        return e

    def answer(v):
        if _type(v) in (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType):
            objects.append(v)  # kept, to be called (HumanEval's check(candidate)) or looked into
            return {"ref": _len(objects) - 1}
        try:
            return {"value": encode(v, [200_000])}  # a giant value is a failure, not a hang
        except NotPlain:
            objects.append(v)
            return {"ref": _len(objects) - 1}

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    failed = None
    try:
        with open(os.path.join(os.path.dirname(sys.argv[2]), "main.py"), encoding="utf-8") as f:  # beside this file
            source = f.read()
        exec(compile(source, "main.py", "exec"), namespace)
    except BaseException as exc:  # noqa: B036  (SystemExit too: the program did not load)
        failed = f"{_type(exc).__name__}: {_str(exc)[:300]}"
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = read(0, 1 << 16)
            if not chunk:
                exit_now(0)
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        try:
            if failed is not None:
                raise RuntimeError(f"the program failed to load: {failed}")
            req = loads(line)
            if req["op"] == "ready":  # the program loaded (its top-level code finished)
                out = {"value": None}
            elif req["op"] == "name":
                out = answer(namespace[req["name"]])
            elif req["op"] == "attr":
                out = answer(getattr(objects[req["ref"]], req["name"]))
            else:
                out = answer(objects[req["ref"]](*decode(req["args"]),
                                                 **{k: decode(v) for k, v in req["kwargs"].items()}))
        except BaseException as exc:  # noqa: B036  (the program's exception, whatever it is, is its answer)
            try:
                out = {"raised": _type(exc).__name__, "message": _str(exc)[:300]}
            except BaseException:  # noqa: B036
                out = {"raised": "Exception", "message": ""}
        try:
            data = (dumps(out) + "\n").encode()
        except BaseException as exc:  # noqa: B036  (an int too long for JSON, say)
            data = (dumps({"raised": "ValueError", "message": _str(_type(exc).__name__)}) + "\n").encode()
        while data:
            data = data[write(reply_fd, data):]


_main()
