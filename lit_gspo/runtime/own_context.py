"""A command run in this process (``lit_gspo.tools.main.main``, ``cli_main`` with ``run=True``, an ablation's arm)
runs in its own copy of the caller's context (:mod:`contextvars`), so the context variables it sets go when it
returns.

Why: jsonargparse keeps the last parser in a context variable it never resets (``subclass_arg_parser``), and that
parser holds the LightningCLI with its trainer, model and data. Run in the caller's context, every in-process fit
(an ablation's arms, a notebook, the tests) kept its model alive until another parse replaced the variable, and
the garbage collector freed it at some later moment, inside whatever ran then. torch's config overrides
(``torch._inductor.config``) are context variables too, so a fit's settings stayed set for its caller.
"""

from __future__ import annotations

import contextvars


def run_in_own_context(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a copy of the current context: it sees the caller's variables, the caller never
    sees what it sets."""
    return contextvars.copy_context().run(fn, *args, **kwargs)
