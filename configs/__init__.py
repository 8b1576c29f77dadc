"""Run configs shipped with eagle-heads (read with ``importlib.resources``; ``eagle --config NAME`` finds them)."""
