"""Reading timeline files back, including the unterminated array of a killed agent."""
import json


def read_events(path):
    """The list of events in a timeline file.

    A file whose writer was killed ends inside the array (maybe even inside a
    line, if the kill interrupted a write): the incomplete last line is dropped
    and the array closed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    body = text.rstrip().rstrip(",")
    return json.loads(body + "]") if body.startswith("[") else []


def metadata(events):
    """The args of the file's bluefog_metadata event (rank, size, hostname, clock offset...)."""
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "bluefog_metadata":
            return ev["args"]
    raise ValueError("no bluefog_metadata event: not a bluefog_lite timeline file")
