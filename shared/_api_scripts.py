"""Lua scripts of the operations the HTTP API and the progress reports added to the run store
(kept beside ``shared/_scripts.py``, built the same way: status literals filled in from the enums,
every key in KEYS, the events channel as the last ARGV).
"""

from __future__ import annotations

from runbrake.shared._scripts import Script, _script

# KEYS: run.  ARGV: (none)
# Like APPROVE, and it says whether this call made the decision: {1, st, 1} the first time, {1, st, 0}
# when the run was approved already (the caller then records nothing new and only re-sends the
# resume message). The caller records the decision as a step only when it made it, so approving twice
# records one approval step.
APPROVE_ONCE = _script("approve_once", """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= '$status_waiting_for_approval' then return {0, st} end
local decided = redis.call('HGET', KEYS[1], 'approval')
if decided == 'approved' then return {1, st, 0} end
if decided ~= false and decided ~= '' then return {0, st} end
redis.call('HSET', KEYS[1], 'approval', 'approved')
return {1, st, 1}
""")

# KEYS: run.  ARGV: progress_json, run_id, events channel
# The latest MCP progress notification of the call in flight (docs/http-api.md, "Events"), written only
# while the run is running (worker/progress.py orders it before the clear when the call ends).
SET_PROGRESS = _script("set_progress", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[1])
redis.call('PUBLISH', ARGV[3], '{"event":"progress","run_id":"' .. ARGV[2] .. '","progress":' .. ARGV[1] .. '}')
return 1
""")

ALL: tuple[Script, ...] = (APPROVE_ONCE, SET_PROGRESS)
