"""The run store's Lua scripts: every transition is one compare-and-set in Redis.

Each script declares every key it touches in KEYS, as Redis Cluster requires; a run's own
keys share the ``{run_id}`` hash tag, so the per-run scripts stay in one slot
(docs/store.md, "The run store"). Transitions answer ``{won, found_status}``:
``won`` is 1 when the transition happened; ``found_status`` is the status the guard saw
("" for no such run).

Status and reason literals are not typed here: the sources are templates whose
``$queued``, ``$cancelled``… placeholders are filled from :class:`RunStatus` and
:class:`TerminationReason` when this module loads, so a renamed status cannot leave a
script guarding an old spelling (a test checks that no template quotes a status itself).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from string import Template

from runbrake.shared.records import SENT_MODEL
from runbrake.shared.status import NON_TERMINAL, RunStatus, TerminationReason


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script's source and its SHA-1 (what EVALSHA names it by)."""

    name: str
    source: str
    template: str
    """The source before the status and reason placeholders were filled in."""
    sha: str
    """What EVALSHA names the script by."""


def _values() -> dict[str, str]:
    values = {f"status_{s.value}": s.value for s in RunStatus}
    values.update({f"reason_{r.value}": r.value for r in TerminationReason if r.value})
    values["sent_model"] = SENT_MODEL
    return values


def _script(name: str, template: str) -> Script:
    source = Template(template).substitute(_values())
    return Script(name, source, template, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 - Redis's naming


_OUTBOX = """
local function outbox(run_id, event)
  local keep = tonumber(ARGV[#ARGV - 1]) or 0
  local entry = {'XADD', KEYS[#KEYS]}
  if keep > 0 then
    local floor = (tonumber(redis.call('TIME')[1]) - keep) * 1000
    if floor > 0 then
      entry[#entry + 1] = 'MINID'
      entry[#entry + 1] = '~'
      entry[#entry + 1] = string.format('%d', floor)
    end
  end
  entry[#entry + 1] = '*'
  entry[#entry + 1] = 'run'
  entry[#entry + 1] = run_id
  local root = redis.call('HGET', KEYS[1], 'root_run_id')
  if root and root ~= '' then event = '{"root_run_id":"' .. root .. '",' .. string.sub(event, 2) end
  entry[#entry + 1] = 'event'
  entry[#entry + 1] = event
  local labels = redis.call('HGET', KEYS[1], 'labels')
  if labels and labels ~= '' then
    entry[#entry + 1] = 'labels'
    entry[#entry + 1] = labels
  end
  local id = redis.call(unpack(entry))
  local tenant = redis.call('HGET', KEYS[1], 'tenant') or ''
  redis.call('PUBLISH', ARGV[#ARGV], '{"id":"' .. id .. '","tenant":"' .. tenant .. '",' .. string.sub(event, 2))
  return id
end
"""
"""Every script that changes a status, or appends a step, writes the event to the namespace's outbox (a Redis
stream, the last KEY; docs/messaging.md, "The outbox") and says so on the events channel (the last ARGV),
in the same script as the change: an event exists exactly when its change does. The stream id is the
event's id, also carried by the PUBLISH (``"id"``), so that a live reader and a replaying one name an event
alike. The outbox is trimmed by age, never by what was published: entries older than the retention (the
ARGV before the channel, seconds; 0 keeps them as long as runs are kept: forever) go, approximately
(``MINID ~``). The run's labels (its hash's ``labels`` field, JSON, where it has one) travel with the
entry for the relay's headers (worker/relay.py). The PUBLISH also names the run's tenant (``"tenant"``, "" for
none; a name of label-key characters, broker/auth.py, so it needs no escaping): the API hands a tenant's
``GET /v1/events`` only its tenant's runs. A run below the first of an agent tree (its hash has
``root_run_id``, a hex id) says so in each event (``"root_run_id"``; docs/usage.md, "Agent trees")."""

_ANNOUNCE = _OUTBOX + """
local function announce(run_id, status, reason)
  return outbox(run_id, '{"event":"status","run_id":"' .. run_id .. '","status":"' .. status ..
    '","termination_reason":"' .. reason .. '"}')
end
"""
"""A status change's event. Written only for a run that exists, whose id the store generated (hex), so the
id needs no escaping."""

_ANNOUNCE_END = _ANNOUNCE + """
local function announce_end(run_id, status, reason, answer)
  local u = redis.call('HMGET', KEYS[1], 'input_tokens', 'output_tokens', 'model_calls', 'cost_usd', 'error')
  local i, o, m = tonumber(u[1]) or 0, tonumber(u[2]) or 0, tonumber(u[3]) or 0
  local usage = string.format('"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d,"model_calls":%d',
    i, o, i + o, m)
  local cost = tonumber(u[4] or '')
  if cost and cost >= 0 and cost < 1e15 then usage = usage .. string.format(',"cost_usd":%.9f', cost) end
  if answer == '' then answer = '"output":null,"output_json":null,"output_truncated":false' end
  local caller = redis.call('HGET', KEYS[1], 'caller_run_id')
  if caller and caller ~= '' then redis.call('PUBLISH', ARGV[#ARGV] .. ':tree-wakes', caller) end
  return outbox(run_id, '{"event":"status","run_id":"' .. run_id .. '","status":"' .. status ..
    '","termination_reason":"' .. reason .. '",' .. answer .. ',' .. usage .. '},"error":' ..
    cjson.encode(u[5] or '') .. '}')
end
"""
"""A terminal status's event (shared/run_end.py): the answer as the caller made it (JSON members, spliced as
text: cjson would turn [] into {}; "" for none), the usage and the error as the run's hash holds them once
the status changed (the counts as integers, the cost rounded to nine decimals as shared/records.py reads it).
A child run of an agent tree (its hash has ``caller_run_id``) also names its caller on the channel
``<events>:tree-wakes`` (``Keys.tree_wakes``): the caller's waiting call wakes (worker/agents.py)."""

_RELEASE = """
local function release(tenants_key)
  local tenant = redis.call('HGET', KEYS[1], 'tenant')
  if tenant and tenant ~= '' then
    if redis.call('HINCRBY', tenants_key, tenant, -1) <= 0 then redis.call('HDEL', tenants_key, tenant) end
  end
end
"""
"""A run of a tenant that reaches a terminal status leaves its tenant's in-flight count (the hash
``<ns>:tenants``, one field per tenant), in the script that wins the transition: a transition wins once, so
a run is released once (docs/http-api.md, "Tenants and quotas")."""

_RETAIN = """
local function retain(run_id, finished_at)
  local keep = tonumber(ARGV[#ARGV - 1])
  if keep and keep > 0 then
    redis.call('ZADD', KEYS[#KEYS - 1], tonumber(finished_at) + keep, run_id)
    for i = #KEYS - 4, #KEYS - 2 do redis.call('EXPIRE', KEYS[i], keep + 600) end
  end
end
"""
"""A run that ends is kept ``retention`` seconds (the ARGV before the channel; 0 keeps it forever): it
enters ``<ns>:finished`` (the KEY before the outbox) at its expiry, which a worker's sweeper acts on (deleting
its keys, its idempotency key and its index entry together); the run's own keys (the three KEYS before it: run,
steps, cancel) also expire ten minutes later, should no sweeper run."""

_REDIS_NOW = """
local function redis_now()
  local t = redis.call('TIME')
  return string.format('%d.%06d', t[1], t[2])
end
local function lease_end(now, lease_s)
  return string.format('%.6f', tonumber(now) + tonumber(lease_s))
end
"""
"""Leases are decided on Redis's own clock, never a client's (docs/leases.md, "Leases"): a
worker's clock that runs ahead or behind cannot reap, or keep, a lease early or late. ``TIME`` in a
script that writes is safe since Redis 5 (effects are replicated, not the script). ``redis_now()``
answers epoch seconds with microseconds as text, the form ``lease_expires_at`` has always had."""

_IS_TERMINAL = """
local function is_terminal(st)
  return """ + " and ".join(f"st ~= '$status_{s.value}'" for s in NON_TERMINAL) + """
end
"""

# KEYS: run, idempotency (may be a dummy key), index, unclaimed, tenants (in-flight counts), tenant enqueues
#   (per tenant: "<minute> <count>"), thread index (a dummy key for a first run), outbox.
# ARGV: run_id, request_json, now, has_idempotency_key ('1'/'0'), idempotency_key, request digest,
#   labels_json, model, input preview, tenant ('' = none), max_runs_in_flight (0 = no bound),
#   max_enqueues_per_minute (0 = no bound), parent run id ('' = a first run), thread root, caller run id ('' =
#   no agent call made it), root run id, depth, ancestors ("/"-separated, the caller first), retention_s,
#   events channel
# The labels, the model's name and the start of the input are kept beside the request as fields of their
# own, so that a listing reads them without the request, which can be large (shared/_store_core.py,
# SUMMARY_FIELDS).
# The idempotency key holds "<run_id> <digest of the request>": the same key with another request is a
# conflict, answered {0, run_id, 'conflict'}, never silently the other run.
# A tenant's quotas are checked and counted here, with the write (docs/http-api.md, "Tenants and quotas"): two
# creates cannot both pass a quota of one. Over one, nothing is written: {0, '', 'quota', name, limit,
# retry_after_s}. The minute is Redis's (TIME), so every replica and worker counts the same window.
CREATE = _script("create", _ANNOUNCE + """
if ARGV[4] == '1' then
  local existing = redis.call('GET', KEYS[2])
  if existing then
    local id, digest = string.match(existing, '^(%S+) ?(%S*)$$')
    if digest ~= '' and digest ~= ARGV[6] then return {0, id, 'conflict'} end
    return {0, id}
  end
end
local tenant = ARGV[10]
local window = ''
if tenant ~= '' then
  local in_flight = tonumber(redis.call('HGET', KEYS[5], tenant) or '0')
  local max_in_flight = tonumber(ARGV[11])
  if max_in_flight > 0 and in_flight >= max_in_flight then
    return {0, '', 'quota', 'max_runs_in_flight', max_in_flight, 0}
  end
  local t = redis.call('TIME')
  local minute = math.floor(tonumber(t[1]) / 60)
  local seen = redis.call('HGET', KEYS[6], tenant) or ''
  local at, count = string.match(seen, '^(%d+) (%d+)$$')
  count = tonumber(count or '0')
  if tonumber(at or '-1') ~= minute then count = 0 end
  local max_per_minute = tonumber(ARGV[12])
  if max_per_minute > 0 and count >= max_per_minute then
    return {0, '', 'quota', 'max_enqueues_per_minute', max_per_minute, 60 - (tonumber(t[1]) % 60)}
  end
  window = minute .. ' ' .. (count + 1)
end
redis.call('HSET', KEYS[1], 'run_id', ARGV[1], 'status', '$status_queued', 'termination_reason', '',
  'created_at', ARGV[3], 'request', ARGV[2], 'seq', 0, 'idempotency_key', ARGV[5], 'labels', ARGV[7],
  'model', ARGV[8], 'input_preview', ARGV[9])
if tenant ~= '' then
  redis.call('HSET', KEYS[1], 'tenant', tenant)
  redis.call('HINCRBY', KEYS[5], tenant, 1)
  redis.call('HSET', KEYS[6], tenant, window)
end
if ARGV[4] == '1' then redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. ARGV[6]) end
if ARGV[13] ~= '' then
  redis.call('HSET', KEYS[1], 'parent_run_id', ARGV[13], 'thread', ARGV[14])
  redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
end
if ARGV[15] ~= '' then
  redis.call('HSET', KEYS[1], 'caller_run_id', ARGV[15], 'root_run_id', ARGV[16], 'depth', ARGV[17],
    'ancestors', ARGV[18])
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
announce(ARGV[1], '$status_queued', '')
return {1, ARGV[1]}
""")

# KEYS: run, leases, unclaimed, outbox.  ARGV: owner, lease_s, run_id, worker (the claiming process's liveness
#   id: docs/leases.md, "Lost workers"), retention_s, events channel
CLAIM = _script("claim", _ANNOUNCE + _REDIS_NOW + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st == '$status_running' and redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  -- this very claim landed before and its answer was lost: it is still this owner's (owners are unique)
  local renewed = lease_end(redis_now(), ARGV[2])
  redis.call('HSET', KEYS[1], 'lease_expires_at', renewed)
  redis.call('ZADD', KEYS[2], renewed, ARGV[3])
  return {1, '$status_queued'}
end
if st ~= '$status_queued' then return {0, st} end
local now = redis_now()
local expires = lease_end(now, ARGV[2])
redis.call('HSET', KEYS[1], 'status', '$status_running', 'owner', ARGV[1], 'started_at', now,
  'lease_expires_at', expires, 'worker', ARGV[4])
redis.call('HDEL', KEYS[1], 'lost_worker')
redis.call('ZADD', KEYS[2], expires, ARGV[3])
redis.call('HINCRBY', KEYS[1], 'segments', 1)
announce(ARGV[3], '$status_running', '')
return {1, st}
""")

# KEYS: run, leases, unclaimed, outbox.  ARGV: owner, lease_s, run_id, worker, retention_s, events channel
RESUME_CLAIM = _script("resume_claim", _ANNOUNCE + _REDIS_NOW + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st == '$status_running' and redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local renewed = lease_end(redis_now(), ARGV[2])
  redis.call('HSET', KEYS[1], 'lease_expires_at', renewed)
  redis.call('ZADD', KEYS[2], renewed, ARGV[3])
  return {1, '$status_waiting_for_approval'}
end
if st ~= '$status_waiting_for_approval' then return {0, st} end
local decided = redis.call('HGET', KEYS[1], 'approval')
if decided ~= 'approved' and decided ~= 'steered' then return {0, st} end
local expires = lease_end(redis_now(), ARGV[2])
redis.call('HSET', KEYS[1], 'status', '$status_running', 'owner', ARGV[1], 'lease_expires_at', expires,
  'approval', 'consumed', 'worker', ARGV[4])
redis.call('ZADD', KEYS[2], expires, ARGV[3])
redis.call('HINCRBY', KEYS[1], 'segments', 1)
announce(ARGV[3], '$status_running', '')
return {1, st}
""")

# KEYS: run, leases, outbox.  ARGV: owner, pending_json, run_id, retention_s, events channel
SUSPEND = _script("suspend", _ANNOUNCE + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= '$status_running' then return {0, st} end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return {0, st, 'owner'} end
redis.call('HSET', KEYS[1], 'status', '$status_waiting_for_approval', 'owner', '', 'lease_expires_at', '',
  'pending', ARGV[2], 'approval', '')
redis.call('ZREM', KEYS[2], ARGV[3])
announce(ARGV[3], '$status_waiting_for_approval', '')
return {1, st}
""")

# KEYS: run, leases, unclaimed, outbox.  ARGV: owner, pending_json, run_id, now, retention_s, events channel
# running → queued (owner-guarded): the worker shuts down and hands the run over
# (docs/leases.md, "Drain and hand-over"). The conversation so far is kept as the pending turn,
# which the next start claim continues from; the run waits in the unclaimed set like a new one, so a
# lost message is re-driven. A cancel that won first leaves the run cancelled: the guard refuses.
HANDOFF = _script("handoff", _ANNOUNCE + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= '$status_running' then return {0, st} end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return {0, st, 'owner'} end
redis.call('HSET', KEYS[1], 'status', '$status_queued', 'owner', '', 'lease_expires_at', '', 'pending', ARGV[2])
redis.call('HDEL', KEYS[1], 'progress')
redis.call('HINCRBY', KEYS[1], 'handoffs', 1)
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
announce(ARGV[3], '$status_queued', '')
return {1, st}
""")

# KEYS: run, unclaimed.  ARGV: now, run_id
# A decision is taken once; approving an approved run again answers won, so that a lost resume message
# can be sent again (the resume claim makes a duplicate a no-op), and says whether this call made the
# decision: {1, st, 1} the first time, {1, st, 0} after, so the caller records one approval step. An
# approved run waits for its resume message in the unclaimed set, like a queued run for its start.
APPROVE = _script("approve", """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= '$status_waiting_for_approval' then return {0, st} end
local decided = redis.call('HGET', KEYS[1], 'approval')
if decided ~= false and decided ~= '' and decided ~= 'approved' then return {0, st} end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
if decided == 'approved' then return {1, st, 0} end
redis.call('HSET', KEYS[1], 'approval', 'approved')
return {1, st, 1}
""")

# KEYS: run, leases, unclaimed, tenants, steer, run, steps, cancel, finished, outbox.
# ARGV: status, reason, owner ('' = not owner-guarded), now, error, required_status ('' = any), run_id,
#   unless steered ('' = regardless), answer (JSON members: shared/run_end.py; '' = none), retention_s,
#   events channel
# A run does not complete while a steer waits for it (docs/cancellation.md, "Steer: the final answer"): the
# completing settle (unless steered) answers {0, status, 'steer'} and the worker goes on with the steer.
SETTLE = _script("settle", _ANNOUNCE_END + _RETAIN + _RELEASE + _IS_TERMINAL + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if is_terminal(st) then return {0, st} end
if ARGV[6] ~= '' and st ~= ARGV[6] then return {0, st} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return {0, st, 'owner'} end
if ARGV[8] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then return {0, st, 'steer'} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'termination_reason', ARGV[2], 'finished_at', ARGV[4],
  'error', ARGV[5], 'lease_expires_at', '')
redis.call('ZREM', KEYS[2], ARGV[7])
redis.call('ZREM', KEYS[3], ARGV[7])
release(KEYS[4])
retain(ARGV[7], ARGV[4])
announce_end(ARGV[7], ARGV[1], ARGV[2], ARGV[9])
return {1, st}
""")

# KEYS: run, cancel, leases, unclaimed, tenants, run, steps, cancel, finished, outbox.
# ARGV: cancel_json, now, run_id, termination reason (cancelled, or a budget's: shared/_store_core.py cancel),
#   retention_s, events channel
CANCEL = _script("cancel", _ANNOUNCE_END + _RETAIN + _RELEASE + _IS_TERMINAL + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if is_terminal(st) then return {0, st} end
redis.call('HSET', KEYS[1], 'status', '$status_cancelled', 'termination_reason', ARGV[4],
  'finished_at', ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
-- A running run stays in the lease set until its lease runs out (REAP then drops it): should its worker be lost,
-- the sweeper still finds it there and records the calls it had in flight (docs/leases.md, "Lost workers").
if st ~= '$status_running' then
  redis.call('HSET', KEYS[1], 'lease_expires_at', '')
  redis.call('ZREM', KEYS[3], ARGV[3])
end
redis.call('ZREM', KEYS[4], ARGV[3])
release(KEYS[5])
retain(ARGV[3], ARGV[2])
announce_end(ARGV[3], '$status_cancelled', ARGV[4], '')
return {1, st}
""")

# KEYS: run, steer, unclaimed.  ARGV: steer_json, now, run_id
# Store a steer (docs/cancellation.md, "Steer") on a running run or one waiting for approval; one at a time: a
# steer pending (not yet applied by the worker) refuses another, {0, st, 'pending'}. A run waiting for approval
# is put back to work like an approval does it (``approval = steered``, in the unclaimed set until its resume
# message is claimed): the resumed segment answers the calls that waited as cancelled and applies the steer.
# The request changes no status and appends no step, so it writes no event: the ``steer`` step the worker
# appends when it applies the steer (STEER_APPLY) is the event.
STEER = _script("steer", """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= '$status_running' and st ~= '$status_waiting_for_approval' then return {0, st} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, st, 'pending'} end
redis.call('SET', KEYS[2], ARGV[1])
if st == '$status_waiting_for_approval' then
  redis.call('HSET', KEYS[1], 'approval', 'steered')
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
end
return {1, st}
""")

# KEYS: run, steer, unclaimed.  ARGV: now, run_id
# A steer stored while the run was still running, whose worker suspended the run for approval before the steer
# reached a boundary: put the run back to work as STEER does for a run that waits (the worker reads the steer
# key after its SUSPEND won, and sends the resume when this answers 1). Idempotent: marking a steered run again
# answers 1 again, and a duplicate resume is a no-op (RESUME_CLAIM).
STEER_WAITING = _script("steer_waiting", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_waiting_for_approval' then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'approval', 'steered')
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
return 1
""")

# KEYS: run, steps, cancel, steer, outbox.
# ARGV: step_body_json, now, run_id, step token, owner, steer id, retention_s, events channel
# Apply the stored steer exactly once: consume it (DEL) and append its ``steer`` step in one script, owner-guarded
# like a worker's append, and idempotent by the step's token like APPEND_STEP (a retry after a lost answer
# answers the same sequence). A cancel wins: with the cancel key set nothing is applied, {0, 1}. A steer that is
# no longer the one the worker read answers {0, 0, 'gone'}. Otherwise {sequence, 0}.
STEER_APPLY = _script("steer_apply", _OUTBOX + """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return {0, 0} end
if redis.call('HGET', KEYS[1], 'last_step') == ARGV[4] then
  return {tonumber(redis.call('HGET', KEYS[1], 'seq')), redis.call('EXISTS', KEYS[3])}
end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[5] then return {0, 0, 'owner'} end
if redis.call('EXISTS', KEYS[3]) == 1 then return {0, 1} end
local pending = redis.call('GET', KEYS[4])
if not pending then return {0, 0, 'gone'} end
local ok, stored = pcall(cjson.decode, pending)
if not ok or type(stored) ~= 'table' or stored['id'] ~= ARGV[6] then return {0, 0, 'gone'} end
redis.call('DEL', KEYS[4])
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('HSET', KEYS[1], 'last_step', ARGV[4])
local record = '{"sequence":' .. seq .. ',"recorded_at":' .. ARGV[2] .. ',' .. string.sub(ARGV[1], 2)
redis.call('RPUSH', KEYS[2], record)
outbox(ARGV[3], '{"event":"step","run_id":"' .. ARGV[3] .. '","step":' .. record .. '}')
return {seq, 0}
""")

# KEYS: run, steps, servers, cancel, servers this hour (kept 8 days), outbox.
# ARGV: step_body_json (an object without sequence/recorded_at), now, server_outcome_field ('' when
#   the step is not a tool step with an outcome), run_id, step token, owner ('' = the
#   step is not a worker's, e.g. a denial; otherwise the claim's owner token, the fence against a worker
#   whose run was reaped or taken over: its writes are refused with {0, 0, 'owner'}), model calls (1 for a
#   model step that answered, else 0), input tokens, output tokens, cost in USD ('' when the model has
#   no prices), the call id of a tool step ('' for other steps), then the marks of the calls that go out
#   next (docs/leases.md, "Lost workers"): the model call's round ('' for none) and the ``sent:<call id>``
#   fields of tool calls; retention_s, events channel
# A tool step forgets its call's MCP progress and closes the call to later progress writes (SET_PROGRESS in
# shared/_api_scripts.py): the step and the end of its progress are one round trip.
# The run's usage (hash fields model_calls, input_tokens, output_tokens, cost_usd) is summed here, with the
# step: a
# step appended once counts once, whichever segment or worker appends it and however often it is retried.
# Answers {sequence, cancelled}. A token already appended answers its sequence again and appends
# nothing: a write retried after a lost answer (docs/leases.md, "Store outages") is recorded once.
# The append and the probe of the boundary it makes are one round
# trip (docs/cancellation.md, "Cancellation: the probe"). The sequence comes from one HINCRBY inside
# the script, so concurrent appends get unique, increasing numbers in list order. The body is
# spliced as text: cjson would turn [] into {}. HEXISTS on the run, not EXISTS: EXISTS is the
# probe's one command, so a count of EXISTS on cancel keys counts probes. The marks ride on the append that
# comes just before their calls (no round trip of their own): written after the step, with its sequence, while
# the run runs.
APPEND_STEP = _script("append_step", _OUTBOX + """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return {0, 0} end
if redis.call('HGET', KEYS[1], 'last_step') == ARGV[5] then
  return {tonumber(redis.call('HGET', KEYS[1], 'seq')), redis.call('EXISTS', KEYS[4])}
end
if ARGV[6] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[6] then return {0, 0, 'owner'} end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('HSET', KEYS[1], 'last_step', ARGV[5])
local body = ARGV[1]
local sep = ','
if body == '{}' then sep = '' end
local record = '{"sequence":' .. seq .. ',"recorded_at":' .. ARGV[2] .. sep .. string.sub(body, 2)
redis.call('RPUSH', KEYS[2], record)
outbox(ARGV[4], '{"event":"step","run_id":"' .. ARGV[4] .. '","step":' .. record .. '}')
if ARGV[7] ~= '0' then
  redis.call('HINCRBY', KEYS[1], 'model_calls', ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[8])
  redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[9])
  if ARGV[10] ~= '' then redis.call('HINCRBYFLOAT', KEYS[1], 'cost_usd', ARGV[10]) end
end
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[5], ARGV[3], 1)
  redis.call('EXPIRE', KEYS[5], 691200)
end
if ARGV[11] ~= '' then
  redis.call('HSET', KEYS[1], 'progress_closed', ARGV[11])
  if redis.call('HGET', KEYS[1], 'progress_call') == ARGV[11] then
    redis.call('HDEL', KEYS[1], 'progress', 'progress_call')
  end
end
if #ARGV > 13 and redis.call('HGET', KEYS[1], 'status') == '$status_running' then
  if ARGV[12] ~= '' then redis.call('HSET', KEYS[1], '$sent_model', ARGV[12] .. ' ' .. seq) end
  for i = 13, #ARGV - 2 do redis.call('HSET', KEYS[1], ARGV[i], seq) end
end
return {seq, redis.call('EXISTS', KEYS[4])}
""")

# KEYS: run, leases.  ARGV: owner, lease_s, run_id
RENEW_LEASE = _script("renew_lease", _REDIS_NOW + """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local expires = lease_end(redis_now(), ARGV[2])
redis.call('HSET', KEYS[1], 'lease_expires_at', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[3])
return 1
""")

# KEYS: leases.  ARGV: limit
# The runs whose lease expired by Redis's clock, oldest first: the reaper's candidates (REAP decides).
EXPIRED_LEASES = _script("expired_leases", _REDIS_NOW + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', redis_now(), 'LIMIT', 0, ARGV[1])
""")

# KEYS: run, leases, tenants, run, steps, cancel, finished, outbox.  ARGV: run_id, retention_s, events channel
# running with an expired lease (by Redis's clock) → failed (lease_lost). A run no longer running leaves
# the lease set; one whose lease was renewed meanwhile is put back at its new expiry.
REAP = _script("reap", _ANNOUNCE_END + _RETAIN + _RELEASE + _REDIS_NOW + """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= '$status_running' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return {0, st or ''}
end
local now = redis_now()
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_expires_at') or '')
if lease and lease > tonumber(now) then
  redis.call('ZADD', KEYS[2], lease, ARGV[1])
  return {0, st}
end
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
redis.call('HSET', KEYS[1], 'status', '$status_failed', 'termination_reason', '$reason_lease_lost',
  'finished_at', now, 'lease_expires_at', '', 'owner', '',
  'error', 'the worker executing the run (' .. owner .. ') stopped renewing its lease')
redis.call('ZREM', KEYS[2], ARGV[1])
release(KEYS[3])
retain(ARGV[1], now)
announce_end(ARGV[1], '$status_failed', '$reason_lease_lost', '')
return {1, st}
""")


# -- lost workers (docs/leases.md, "Lost workers") ----------------------------------------------

# KEYS: workers, lost workers.  ARGV: worker id, lost_s
# A worker process says it is alive: its entry in the workers set is pushed to ``lost_s`` after now (Redis's
# clock). A worker already taken as lost (in the lost set, or its entry expired: a sweeper takes it next) is
# never alive again: answers 0, and the process stops what it runs and takes a new id.
BEAT = _script("beat", _REDIS_NOW + """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
local now = redis_now()
local alive_until = redis.call('ZSCORE', KEYS[1], ARGV[1])
if alive_until and tonumber(alive_until) < tonumber(now) then return 0 end
redis.call('ZADD', KEYS[1], lease_end(now, ARGV[2]), ARGV[1])
return 1
""")

# KEYS: workers, lost workers.  ARGV: limit, keep_s
# Take the workers whose liveness expired by Redis's clock: each moves to the lost set (scored by when), so
# exactly one sweeper takes it and its beat is refused from then on. Lost entries older than ``keep_s`` go.
LAPSE = _script("lapse", _REDIS_NOW + """
local now = redis_now()
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[1])
for _, worker in ipairs(lapsed) do
  redis.call('ZREM', KEYS[1], worker)
  redis.call('ZADD', KEYS[2], now, worker)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(now) - tonumber(ARGV[2]))
return lapsed
""")

# KEYS: run.  ARGV: owner, worker id
# A process taken as lost while it lived goes on under a new id with the runs nobody took from it yet: each is
# stamped with the new id, owner-guarded (a run a sweeper took meanwhile has another owner: refused, 0).
RESTAMP = _script("restamp", """
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 0 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'worker', ARGV[2])
return 1
""")

# KEYS: run, cancel.  ARGV: owner, field
# Before a call's request goes out, its mark (``sent:<call id>`` or ``sent:model``) is written with the run's
# last step sequence (and, for the model, the round: ARGV[3]), owner-guarded: a worker whose run was taken
# from it writes nothing and sends nothing. Written here only when no append just before carried it
# (APPEND_STEP's marks): before a segment's first model call, where it is also the probe of that boundary.
# Answers 1; 0 when the run is not this owner's; 2 when it is but no longer runs or its cancel key is set.
MARK_SENT = _script("mark_sent", """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'status') ~= '$status_running' then return 2 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
local seq = redis.call('HGET', KEYS[1], 'seq') or '0'
if ARGV[3] then seq = ARGV[3] .. ' ' .. seq end
redis.call('HSET', KEYS[1], ARGV[2], seq)
return 1
""")

# KEYS: run. ARGV: owner, field, value (none: the field is deleted). Answers 0 when the run is not the owner's.
KEEP_TASK = _script("keep_task", """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[3] then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) else redis.call('HDEL', KEYS[1], ARGV[2]) end
return 1
""")

# KEYS: run, steps, leases, unclaimed, servers, servers this hour, tenants, run, steps, cancel, finished, outbox.
# ARGV: run_id, lost worker, expected seq, mode ('requeue' | 'fail' for a running run, 'ended' for one that ended),
#   pending_json, error, now, step count n,
#   then n pairs (step body, server outcome field or ''), retention_s, events channel
# The run of a lost worker, in one script: guarded by that worker still being the run's and by the steps the
# sweeper read (``seq``: nothing was appended since, so the steps it built say what is true) and by the status it
# read (running or ended), the steps of the
# calls cut off are appended; then a running run goes back to ``queued`` with its rebuilt conversation as the
# pending turn (``requeue``), or ends ``failed``/``lease_lost`` (``fail``). A run that ended meanwhile (a cancel
# while its worker was dead) gets the steps, and keeps its status. Answers {1, st, losses} when requeued,
# {2, st} for a run already ended, {3, st, losses} when failed; {0, st, why} when the guard refused.
RECLAIM = _script("reclaim", _ANNOUNCE + _RETAIN + _RELEASE + _IS_TERMINAL + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[2] then return {0, st, 'worker'} end
if tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') ~= tonumber(ARGV[3]) then return {0, st, 'moved'} end
local running = st == '$status_running'
if not running and not is_terminal(st) then
  redis.call('HSET', KEYS[1], 'worker', '')
  return {0, st, 'worker'}
end
if (ARGV[4] == 'ended') == running then return {0, st, 'moved'} end
local n = tonumber(ARGV[8])
for i = 1, n do
  local body = ARGV[7 + 2 * i]
  local counter = ARGV[8 + 2 * i]
  local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
  local record = '{"sequence":' .. seq .. ',"recorded_at":' .. ARGV[7] .. ',' .. string.sub(body, 2)
  redis.call('RPUSH', KEYS[2], record)
  outbox(ARGV[1], '{"event":"step","run_id":"' .. ARGV[1] .. '","step":' .. record .. '}')
  if counter ~= '' then
    redis.call('HINCRBY', KEYS[5], counter, 1)
    redis.call('HINCRBY', KEYS[6], counter, 1)
    redis.call('EXPIRE', KEYS[6], 691200)
  end
end
redis.call('HSET', KEYS[1], 'worker', '', 'lost_worker', ARGV[2])
redis.call('HDEL', KEYS[1], 'progress')
if not running then return {2, st} end
local losses = redis.call('HINCRBY', KEYS[1], 'worker_losses', 1)
redis.call('ZREM', KEYS[3], ARGV[1])
if ARGV[4] == 'fail' then
  redis.call('HSET', KEYS[1], 'status', '$status_failed', 'termination_reason', '$reason_lease_lost',
    'finished_at', ARGV[7], 'lease_expires_at', '', 'owner', '', 'error', ARGV[6])
  redis.call('ZREM', KEYS[4], ARGV[1])
  release(KEYS[7])
  retain(ARGV[1], ARGV[7])
  announce(ARGV[1], '$status_failed', '$reason_lease_lost')
  return {3, st, losses}
end
redis.call('HSET', KEYS[1], 'status', '$status_queued', 'owner', '', 'lease_expires_at', '', 'pending', ARGV[5])
redis.call('ZADD', KEYS[4], ARGV[7], ARGV[1])
announce(ARGV[1], '$status_queued', '')
return {1, st, losses}
""")


# KEYS: unclaimed, run.  ARGV: run_id, cutoff, now
# Take the re-drive of one run whose message was sent before ``cutoff`` and that nobody claimed: answers
# 'start' (queued) or 'resume' (approved, waiting for its resume), and restarts its clock so that one
# worker re-sends it once per interval; a run that moved on leaves the set ('').
REDRIVE = _script("redrive", """
local sent = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not sent or tonumber(sent) > tonumber(ARGV[2]) then return '' end
local st = redis.call('HGET', KEYS[2], 'status')
local kind = ''
if st == '$status_queued' then kind = 'start' end
if st == '$status_waiting_for_approval' then
  local decided = redis.call('HGET', KEYS[2], 'approval')
  if decided == 'approved' or decided == 'steered' then kind = 'resume' end
end
if kind == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
end
return kind
""")


# KEYS: outbox.  ARGV: group
# The relay's consumer group on an outbox, made once (with the stream, should no event exist yet) from the
# stream's start: 1 when this call made it, 0 when it existed.
OUTBOX_GROUP = _script("outbox_group", """
local made = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(made) == 'table' and made.err then
  if string.find(made.err, 'BUSYGROUP', 1, true) then return 0 end
  return redis.error_reply(made.err)
end
return 1
""")

# KEYS: an outbox.  ARGV: retention seconds.  Every entry older than the retention goes, exactly (the XADDs trim
# approximately, whole stream nodes: docs/messaging.md, "The outbox"); answers how many.
OUTBOX_TRIM = _script("outbox_trim", """
local floor = (tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])) * 1000
if floor <= 0 then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d', floor))
""")

# KEYS: relay lease.  ARGV: relay name, lease_ms
# The one relay that publishes (docs/messaging.md, "The relay"): the holder renews, another takes the
# lease only once it expired. Answers 1 when ``relay name`` holds it now.
RELAY_LEASE = _script("relay_lease", """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
""")

# KEYS: relay lease.  ARGV: relay name
RELAY_RELEASE = _script("relay_release", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
""")


# -- webhooks (docs/webhooks.md, "How delivery works") ------------------------------------------------

# KEYS: delivery hash, the line of its (webhook, run), due set, log.  ARGV: member, now, then field/value pairs
# A delivery of one event to one webhook, queued behind the run's earlier ones for that webhook. Answers 0 when
# it exists already (the outbox handed the event out again: at least once, queued once).
WEBHOOK_QUEUE = _script("webhook_queue", """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('RPUSH', KEYS[2], KEYS[1])
redis.call('ZADD', KEYS[3], 'NX', ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], KEYS[1])
return 1
""")

# KEYS: delivery hash, its line, due set, log, failing set.  ARGV: member, outcome (delivered|retrying|
# gave_up), now, next attempt at, then field/value pairs to record. Delivered or given up: the line moves on
# to its next delivery (due now), or leaves the due set when empty. Retrying: the line waits until ``next``.
WEBHOOK_RESULT = _script("webhook_result", """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
redis.call('ZADD', KEYS[4], ARGV[3], KEYS[1])
if ARGV[2] == 'retrying' then
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
  redis.call('ZADD', KEYS[5], ARGV[3], KEYS[1])
  return 1
end
if ARGV[2] == 'delivered' then
  redis.call('ZREM', KEYS[5], KEYS[1])
else
  redis.call('ZADD', KEYS[5], ARGV[3], KEYS[1])
end
if redis.call('LINDEX', KEYS[2], 0) == KEYS[1] then redis.call('LPOP', KEYS[2]) end
if redis.call('LLEN', KEYS[2]) > 0 then
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[3], ARGV[1])
end
return 1
""")
# KEYS: children (the caller's hash: call id -> child run id), the caller's run.  ARGV: call id, child run id
ADD_CHILD = _script("add_child", """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
""")
"""A caller records the child run its agent call started before it waits for it (docs/usage.md, "Agent
trees"); the hash expires with the caller's run once that has a retention expiry, and goes with it when swept."""

# KEYS: an ancestor's run.  ARGV: tokens, cost in USD ('' = none), the tree-wakes channel, the ancestor's id, and
# with a step's append, the run below and the append's token ('' = none)
ADD_BELOW = _script("add_below", """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[5] and ARGV[5] ~= '' then
  local counted = 'below_counted:' .. ARGV[5]
  if redis.call('HGET', KEYS[1], counted) == ARGV[6] then return 0 end
  redis.call('HSET', KEYS[1], counted, ARGV[6])
end
if ARGV[1] ~= '0' then redis.call('HINCRBY', KEYS[1], 'below_tokens', ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HINCRBYFLOAT', KEYS[1], 'below_cost_usd', ARGV[2]) end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
""")
"""A model step of a run below counts against each run above it in its agent tree, whose budget reads it
(shared/_store_core.py, ``budget_use``), and wakes the ancestor's waiting call to count it now. Sent with the
step's append, in its round trip: the ancestor keeps the last append token it counted of each run below, so an
append sent again (a retry after a lost answer) is counted once."""

ALL = (CREATE, CLAIM, RESUME_CLAIM, SUSPEND, HANDOFF, APPROVE, SETTLE, CANCEL, APPEND_STEP, RENEW_LEASE, EXPIRED_LEASES,
       ADD_CHILD, ADD_BELOW, STEER, STEER_WAITING, STEER_APPLY, REAP, BEAT, LAPSE, RESTAMP, MARK_SENT, RECLAIM, REDRIVE,
       OUTBOX_GROUP,
       OUTBOX_TRIM, RELAY_LEASE, RELAY_RELEASE, WEBHOOK_QUEUE, WEBHOOK_RESULT)
"""Every script, for loading them all after Redis lost its script cache (a restart, SCRIPT FLUSH)."""
