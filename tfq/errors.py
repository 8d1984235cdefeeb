"""The one error users see: a single line saying what is wrong and how to mend it (exit code 2)."""


class TfqError(Exception):
    """Bad input or an unusable environment. The CLI prints `tfq: <message>` and exits 2."""


class Unservable(TfqError):
    """The engine can compute no forward any more (a tensor-parallel group torn down after a fault): a server
    goes down at once, for its supervisor to restart it, rather than failing request after request."""


def own_fault(e: BaseException) -> bool:
    """Whether an exception raised by one stream's own work (its grammar, penalties, text) is that stream's
    alone to fail with: any error, and a Rust library's panic (pyo3's PanicException is a BaseException); not an
    interrupt or an exit, which stop the process."""
    return not isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))
