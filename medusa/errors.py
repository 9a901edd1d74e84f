"""User-facing errors.

Every problem a user can fix (a wrong path, heads made for another model, a prompt that
does not fit) raises :class:`MedusaError` with a one-line message naming the problem and
the fix. The CLIs print that line and exit non-zero instead of showing a traceback.
"""


class MedusaError(Exception):
    """An error caused by input the user can correct; its message is one line."""
