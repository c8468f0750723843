"""The one error type the library raises for anything a user can fix."""


class AttnprobeError(Exception):
    """A bad input or an unusable model: the message is one line that names the fix."""


def plain(value: object) -> str:
    """A value for a message as a person writes it: 5, not np.int64(5); 0.5, not np.float64(0.5); a whole float
    as a whole number. (numpy is not imported here: the CLI imports this module before numpy is needed.)"""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()  # a numpy scalar (or 0-d array) -> the Python number
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(plain(v) for v in value) + ")"
    return str(value)
