"""Lua scripts of the operations the HTTP API and the progress reports added to the run store
(kept beside ``shared/_scripts.py``, built the same way: status literals filled in from the enums,
every key in KEYS, the events channel as the last ARGV).
"""

from __future__ import annotations

from runbrake.shared._scripts import Script, _script

# KEYS: run.  ARGV: progress_json, run_id, events channel
# The latest MCP progress notification of the call in flight (docs/http-api.md, "Events"), written only
# while the run is running (worker/progress.py orders it before the clear when the call ends).
SET_PROGRESS = _script("set_progress", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[1])
redis.call('PUBLISH', ARGV[3], '{"event":"progress","run_id":"' .. ARGV[2] .. '","progress":' .. ARGV[1] .. '}')
return 1
""")

# KEYS: run.  ARGV: delta_json, run_id, events channel
# The text a model call streamed since the last delta (docs/http-api.md, "Events"): announced only, never
# kept (worker/deltas.py), and only while the run is running, so none follows a cancel that won the fence.
PUBLISH_DELTA = _script("publish_delta", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
redis.call('PUBLISH', ARGV[3], '{"event":"delta","run_id":"' .. ARGV[2] .. '","delta":' .. ARGV[1] .. '}')
return 1
""")

ALL: tuple[Script, ...] = (SET_PROGRESS, PUBLISH_DELTA)
