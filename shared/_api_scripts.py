"""Lua scripts of the operations the HTTP API and the progress reports added to the run store
(kept beside ``shared/_scripts.py``, built the same way: status literals filled in from the enums,
every key in KEYS, the events channel as the last ARGV).
"""

from __future__ import annotations

from runbrake.shared._scripts import Script, _script

# KEYS: run.  ARGV: progress_json, run_id, call id, events channel
# The latest MCP progress notification of the call in flight (docs/http-api.md, "Events"), written only
# while the run is running and the call's step is not recorded yet: the append of a tool step names its call
# in 'progress_closed' (APPEND_STEP), so a write that was on its way when the call ended lands as nothing
# (worker/progress.py writes without waiting for the call's end, and the end without waiting for a write).
SET_PROGRESS = _script("set_progress", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
if redis.call('HGET', KEYS[1], 'progress_closed') == ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[1], 'progress_call', ARGV[3])
redis.call('PUBLISH', ARGV[4], '{"event":"progress","run_id":"' .. ARGV[2] .. '","progress":' .. ARGV[1] .. '}')
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

# KEYS: an outbox.  ARGV: after (a stream id: the entries after it), tenant ('' for every run's), entries to read.
# A page of GET /v1/events' replay (docs/http-api.md, "Events: resuming"): of the next entries, only the status
# changes of the tenant's runs (the label tenant their entry carries) leave Redis, so what the API reads and
# parses for a tenant does not grow with other tenants' events and steps. Answers {the id of the last entry
# read ('' for none), how many were read, {id, fields} of each status change kept}.
FEED_SCAN = _script("feed_scan", """
local function tenant_of(labels)
  if not labels or labels == '' then return '' end
  local ok, decoded = pcall(cjson.decode, labels)
  if ok and type(decoded) == 'table' and type(decoded['tenant']) == 'string' then return decoded['tenant'] end
  return ''
end
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[3])
local kept = {}
for _, entry in ipairs(entries) do
  local event, labels = '', ''
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'event' then event = fields[i + 1] elseif fields[i] == 'labels' then labels = fields[i + 1] end
  end
  if string.sub(event, 1, 17) == '{"event":"status"' and (ARGV[2] == '' or tenant_of(labels) == ARGV[2]) then
    kept[#kept + 1] = entry
  end
end
local last = ''
if #entries > 0 then last = entries[#entries][1] end
return {last, #entries, kept}
""")

ALL: tuple[Script, ...] = (SET_PROGRESS, PUBLISH_DELTA, FEED_SCAN)
