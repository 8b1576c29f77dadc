"""User-facing errors: the CLI prints these as one clear message, without a traceback."""


class EagleError(Exception):
    """A problem with the user's input or environment; the message names the problem and the fix."""
