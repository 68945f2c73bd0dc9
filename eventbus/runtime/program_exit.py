"""The end of an eventbus program: exit without the interpreter's last garbage collections."""

from __future__ import annotations

import gc

__all__ = ["without_final_collection"]


def without_final_collection(code: int) -> int:
    """``code``, once every object alive now is exempt from the garbage collector (``gc.freeze``).

    Why: at exit the interpreter's collections walk every object still alive. With torch imported
    (its optimizers pull in ``torch._dynamo``) that is ~1 s of CPU at every exit of a trainer or a
    checkpoint daemon, after its work is done. By now the program has closed what it opened;
    the operating system takes the memory back. Only for a program's main, never inside one."""
    gc.freeze()
    return code
