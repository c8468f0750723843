"""The one error type the library raises for anything a user can fix."""


class AttnprobeError(Exception):
    """A bad input or an unusable model: the message is one line that names the fix."""
