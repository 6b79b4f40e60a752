"""Triton's interpreter, patched once per launch.

Under TRITON_INTERPRET=1 every call of a @triton.jit helper inside a kernel (and Triton's own, such as
tl.zeros) re-patches triton.language for the interpreter, though the launch patched it already and the
patches of a helper's call are never undone: scanning the modules' members again is most of the time a
small kernel spends in the interpreter. Here a helper patches only the language modules the launch has not
patched yet, so each launch scans each module once; the kernels run the same interpreted operations.
"""
from __future__ import annotations

import inspect


def patch_once_per_launch() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return

    executor, function = interpreter.GridExecutor, interpreter.InterpretedFunction
    if not all(hasattr(x, a) for x, a in ((interpreter, "_patch_lang"), (executor, "__call__"),
                                          (function, "rewrite"), (interpreter, "InterpreterError"))):
        return  # another Triton: leave its interpreter as it is
    langs_of: dict = {}
    patched: list[set] = []  # per running launch: the language modules patched so far

    def langs(fn) -> frozenset:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    launch = executor.__call__

    def launch_once(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        need = langs(self.fn)
        if not patched or not need <= patched[-1]:
            interpreter._patch_lang(self.fn)
            if patched:
                patched[-1] |= need
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__ = launch_once
    function.__call__ = device_call
