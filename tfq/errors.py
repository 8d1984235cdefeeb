"""The one error users see: a single line saying what is wrong and how to mend it (exit code 2)."""


class TfqError(Exception):
    """Bad input or an unusable environment. The CLI prints `tfq: <message>` and exits 2."""
