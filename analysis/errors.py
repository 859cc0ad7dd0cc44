"""The one error type users see: a clear, one-line message, no traceback."""


class AttnpatError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` and exits 2; the app shows the message."""

    def __init__(self, message: str):
        # One line always: multi-line messages are folded so logs and terminals stay readable.
        super().__init__(" ".join(str(message).split()))
