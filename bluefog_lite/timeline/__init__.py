"""Per-agent timeline: recording (hot path), the background writer, and control."""
from ._api import timeline_context, timeline_end_activity, timeline_start_activity
from ._control import timeline_start, timeline_stop
