"""Per-agent timeline: recording (hot path), the background writer, and control."""
