"""The run store's Lua scripts: every transition is one compare-and-set in Redis.

Each script declares every key it touches in KEYS (DESIGN.md section 8). A run's
own keys share the ``{run_id}`` hash tag, so the per-run scripts stay in one slot.
Scripts answer ``{won, found_status}``: ``won`` is 1 when the transition
happened; ``found_status`` is the status the guard saw ("" for no such run).
"""

from __future__ import annotations

_TERMINAL_CHECK = """
local function is_terminal(st)
  return st ~= 'queued' and st ~= 'running' and st ~= 'waiting_for_approval'
end
"""

# KEYS: run, idempotency (may be a dummy key), index.
# ARGV: run_id, request_json, now, has_idempotency_key ('1'/'0'), idempotency_key
CREATE = """
if ARGV[4] == '1' then
  local existing = redis.call('GET', KEYS[2])
  if existing then return {0, existing} end
end
redis.call('HSET', KEYS[1], 'run_id', ARGV[1], 'status', 'queued', 'termination_reason', '',
  'created_at', ARGV[3], 'request', ARGV[2], 'seq', 0, 'idempotency_key', ARGV[5])
if ARGV[4] == '1' then redis.call('SET', KEYS[2], ARGV[1]) end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return {1, ARGV[1]}
"""

# KEYS: run, leases.  ARGV: owner, now, lease_expires_at, run_id
CLAIM = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= 'queued' then return {0, st} end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'started_at', ARGV[2],
  'lease_expires_at', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'segments', 1)
return {1, st}
"""

# KEYS: run, leases.  ARGV: owner, now, lease_expires_at, run_id
RESUME_CLAIM = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= 'waiting_for_approval' then return {0, st} end
if redis.call('HGET', KEYS[1], 'approval') ~= 'approved' then return {0, st} end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'lease_expires_at', ARGV[3],
  'approval', 'consumed')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'segments', 1)
return {1, st}
"""

# KEYS: run, leases.  ARGV: owner, pending_json, run_id
SUSPEND = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= 'running' then return {0, st} end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return {0, st, 'owner'} end
redis.call('HSET', KEYS[1], 'status', 'waiting_for_approval', 'owner', '', 'lease_expires_at', '',
  'pending', ARGV[2], 'approval', '')
redis.call('ZREM', KEYS[2], ARGV[3])
return {1, st}
"""

# KEYS: run.  ARGV: (none)
# A decision is taken once; approving an approved run again answers won so a lost resume message
# can be sent again (the resume claim makes a duplicate a no-op).
APPROVE = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= 'waiting_for_approval' then return {0, st} end
local decided = redis.call('HGET', KEYS[1], 'approval')
if decided ~= false and decided ~= '' and decided ~= 'approved' then return {0, st} end
redis.call('HSET', KEYS[1], 'approval', 'approved')
return {1, st}
"""

# KEYS: run, leases.
# ARGV: status, reason, owner ('' = not owner-guarded), now, error, required_status ('' = any), run_id
SETTLE = _TERMINAL_CHECK + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if is_terminal(st) then return {0, st} end
if ARGV[6] ~= '' and st ~= ARGV[6] then return {0, st} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return {0, st, 'owner'} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'termination_reason', ARGV[2], 'finished_at', ARGV[4],
  'error', ARGV[5], 'lease_expires_at', '')
redis.call('ZREM', KEYS[2], ARGV[7])
return {1, st}
"""

# KEYS: run, cancel, leases.  ARGV: cancel_json, now, run_id
CANCEL = _TERMINAL_CHECK + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if is_terminal(st) then return {0, st} end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'termination_reason', 'cancelled',
  'finished_at', ARGV[2], 'lease_expires_at', '')
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[3])
return {1, st}
"""

# KEYS: run, steps, servers.  ARGV: step_body_json (an object without sequence/recorded_at), now,
#   server_outcome_field ('' when the step is not a tool step with an outcome)
# The sequence comes from one HINCRBY inside the script, so concurrent appends get unique,
# increasing numbers in list order. The body is spliced as text: cjson would turn [] into {}.
# HEXISTS, not EXISTS: EXISTS is the probe's one command, so a count of EXISTS counts probes.
APPEND_STEP = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return 0 end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
local body = ARGV[1]
local sep = ','
if body == '{}' then sep = '' end
redis.call('RPUSH', KEYS[2], '{"sequence":' .. seq .. ',"recorded_at":' .. ARGV[2] .. sep .. string.sub(body, 2))
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
return seq
"""

# KEYS: run, leases.  ARGV: owner, lease_expires_at, run_id
RENEW_LEASE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_expires_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

# KEYS: run, leases.  ARGV: now, run_id
# running with an expired lease → failed (lease_lost). A run no longer running leaves the lease set;
# one whose lease was renewed meanwhile is put back at its new expiry.
REAP = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'running' then
  redis.call('ZREM', KEYS[2], ARGV[2])
  return {0, st or ''}
end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_expires_at') or '')
if lease and lease > tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[2], lease, ARGV[2])
  return {0, st}
end
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
redis.call('HSET', KEYS[1], 'status', 'failed', 'termination_reason', 'lease_lost', 'finished_at', ARGV[1],
  'error', 'the worker executing the run (' .. owner .. ') stopped renewing its lease', 'lease_expires_at', '')
redis.call('ZREM', KEYS[2], ARGV[2])
return {1, st}
"""
