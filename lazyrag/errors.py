"""Error classes the command line maps to exit codes (lazyrag/cli.py): the store's own
`lazyrag.store.StoreError` is 4, these two are 3 and 5."""


class InputError(Exception):
    """Bad input: a query or corpus file's content (named `file:line: reason`), or an input path
    that cannot be read. Exit code 3."""


class WorkerFailed(Exception):
    """An `index --workers` worker raised or died; ``code`` is the exit code its failure has, as the
    worker classified it (lazyrag/failures.py)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ResourceError(Exception):
    """Not enough of a resource: disk space, memory, or a cache too small for one request.
    The message says how much is needed. Exit code 5."""
