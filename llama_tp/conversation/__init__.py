"""Conversations: `Chat` (multi-turn, reusing the cache) and tool calls (in `Chat` and,
parsed from a reply, the server's)."""
