"""Ray Serve front end: ``serve run kdray.serve:app [model=... drafter=... tp=... budget=...]``."""
from kdray.serve.app import ServeArgs, app

__all__ = ["ServeArgs", "app"]
