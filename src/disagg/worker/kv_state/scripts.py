"""Lua scripts: the state changes that must be atomic (Redis runs each script alone).

Times are milliseconds. A `now` argument below 0 means "Redis's own clock", so leases do not
depend on the clocks of the workers; tests pass explicit times.
"""

from __future__ import annotations

_NOW = """
local function now_ms(arg)
  local n = tonumber(arg)
  if n >= 0 then return n end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: worker, workers; ARGV: ttl_ms, now, worker_id, running, waiting, free_blocks, total_blocks
HEARTBEAT = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'running', ARGV[4], 'waiting', ARGV[5], 'free_blocks', ARGV[6],
           'total_blocks', ARGV[7], 'heartbeat_ms', now_ms(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: worker, workers; ARGV: ttl_ms, now, worker_id, then field/value pairs
REGISTER = (
    _NOW
    + """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'heartbeat_ms', now_ms(ARGV[2]), unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: transfer, leases, generation; ARGV: request_id, prefill_owner, decode_owner, dst_json,
# lease_ms, now -> {generation, expiry_ms} or {-1, 0} when the record exists
BEGIN_TRANSFER = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, 0} end
local now = now_ms(ARGV[6])
local gen = redis.call('INCR', KEYS[3])
local expiry = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'prefill_owner', ARGV[2], 'decode_owner', ARGV[3],
           'dst_blocks', ARGV[4], 'generation', gen, 'lease_expiry_ms', expiry, 'created_ms', now)
redis.call('ZADD', KEYS[2], expiry, ARGV[1])
return {gen, expiry}
"""
)

# Checks the caller's generation, then pushes the lease out.
# KEYS: transfer, leases; ARGV: generation, lease_ms, now, request_id
# -> {'ok', expiry} | {'gone', 0} | {'stale', current}
RENEW_TRANSFER = (
    _NOW
    + """
local gen = redis.call('HGET', KEYS[1], 'generation')
if not gen then return {'gone', 0} end
if gen ~= ARGV[1] then return {'stale', gen} end
local expiry = now_ms(ARGV[3]) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_expiry_ms', expiry)
redis.call('ZADD', KEYS[2], expiry, ARGV[4])
return {'ok', expiry}
"""
)

# A new prefill owner takes over: generation bumped, so the old owner's Prefill is refused.
# KEYS: transfer, leases, generation; ARGV: generation, new_prefill_owner, lease_ms, now, request_id
# -> {'ok', new_generation} | {'gone', 0} | {'stale', current}
REASSIGN = (
    _NOW
    + """
local gen = redis.call('HGET', KEYS[1], 'generation')
if not gen then return {'gone', 0} end
if gen ~= ARGV[1] then return {'stale', gen} end
local new = redis.call('INCR', KEYS[3])
local expiry = now_ms(ARGV[4]) + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'generation', new, 'prefill_owner', ARGV[2], 'lease_expiry_ms', expiry)
redis.call('ZADD', KEYS[2], expiry, ARGV[5])
return {'ok', new}
"""
)

# KEYS: transfer, leases; ARGV: generation, request_id -> 'ok' | 'gone' | 'stale'
FINISH_TRANSFER = """
local gen = redis.call('HGET', KEYS[1], 'generation')
if not gen then return 'gone' end
if gen ~= ARGV[1] then return 'stale' end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 'ok'
"""

# Reap one transfer if its lease is still expired: delete it and queue its blocks for the decode
# worker that reserved them (a prefill worker learns of an abandoned transfer from its Prefill call,
# cancelled when the decode worker goes away). Two reapers racing on the same id: the second finds
# no lease entry and does nothing.
# KEYS: transfer, leases; ARGV: request_id, now, reclaims_prefix, reclaim_ttl_ms -> reclaims queued, or -1
REAP_TRANSFER = (
    _NOW
    + """
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score then return -1 end
if tonumber(score) > now_ms(ARGV[2]) then return -1 end
redis.call('ZREM', KEYS[2], ARGV[1])
local rec = redis.call('HMGET', KEYS[1], 'generation', 'decode_owner', 'dst_blocks')
redis.call('DEL', KEYS[1])
if not rec[1] or not rec[2] or rec[2] == '' or rec[3] == '[]' then return 0 end
local entry = cjson.encode({request_id = ARGV[1], generation = tonumber(rec[1]), reason = 'lease_expired'})
entry = string.sub(entry, 1, -2) .. ',"blocks":' .. rec[3] .. '}'
redis.call('RPUSH', ARGV[3] .. rec[2], entry)
redis.call('PEXPIRE', ARGV[3] .. rec[2], ARGV[4])
return 1
"""
)

# Drop a dead worker's prefix-index entries, unless it came back meanwhile.
# KEYS: worker, workers, worker_blocks; ARGV: worker_id, block_prefix -> entries removed, or -1
DROP_WORKER_INDEX = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local hashes = redis.call('SMEMBERS', KEYS[3])
for _, h in ipairs(hashes) do redis.call('SREM', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[2], ARGV[1])
return #hashes
"""

# KEYS: reclaims -> the list's entries, which are removed
DRAIN = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
return items
"""
