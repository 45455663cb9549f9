"""`asynclane-jax convert` (placeholder until the converter lands)."""


def register(sub) -> None:
    del sub
