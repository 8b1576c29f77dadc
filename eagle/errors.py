"""User-facing errors: the CLI prints these as one clear message, without a traceback."""


class EagleError(Exception):
    """A problem with the user's input or environment; the message names the problem and the fix."""


class CheckFailed(EagleError):
    """A check the user asked for ran and failed (e.g. engine parity): the CLI exits with status 1, not 2."""
