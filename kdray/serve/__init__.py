"""Ray Serve front end: ``serve run kdray.serve:app [model=... drafter=... tp=... budget=...]``."""
from kdray.serve.args import ServeArgs


def __getattr__(name: str):
    """``app`` on first use: it imports Ray Serve and FastAPI, which ``kdray generate`` never needs."""
    if name == "app":
        from kdray.serve.server import app

        return app
    raise AttributeError(f"module 'kdray.serve' has no attribute '{name}'")


__all__ = ["ServeArgs", "app"]
