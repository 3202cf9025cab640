"""One-sided window operations (MPI RMA windows driven by the communication thread)."""
from ._runtime import state


def win_free(name=None):
    """Free one window (by name) or all of them (name=None)."""
    st = state()
    if name is None:
        names = list(st.windows)
    else:
        if name not in st.windows:
            raise ValueError(f"win_free: no window named {name!r}")
        names = [name]
    for n in names:
        st.windows.pop(n).free()
    return True
