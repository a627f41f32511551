"""The Triton interpreter, faster for the CPU checks: it patches triton.language (inspect.getmembers
of its modules, ~0.4 ms) anew on every call of a @triton.jit helper, though the kernel's launch or
an earlier call has patched it already; the kernels call many small helpers, so that is most of a
launch's time. Skipping a patch while tl and tl.core stay patched changes nothing they compute
(the patch binds the same interpreter semantics). A Triton without this internal runs as is."""
import os


def speed_up_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "skips_repeats", False) or not hasattr(interpreter, "_LangPatchScope"):
        return

    def patch_lang(fn):
        if tl.core.is_builtin(tl.full) or tl.core.is_builtin(tl.core.full):
            return patch(fn)
        return interpreter._LangPatchScope()  # nothing to restore

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
