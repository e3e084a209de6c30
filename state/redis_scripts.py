"""The Lua scripts behind state/redis_state.py's multi-key writes and reads.

Each runs atomically in Redis, so no reader sees half a batch; the key schema they touch is
documented in redis_state.py and docs/redis_schema.md. Only redis_state.py uses them.
"""

# KEYS: epoch, info, load, workers. ARGV: worker id, epoch, info, load ("" keeps it), ttl ms.
# Returns -1 when fenced, else 1 if the lease existed before, 0 if it was (re)created.
HEARTBEAT = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[2])
if cur > mine then return -1 end
if cur < mine then redis.call('SET', KEYS[1], mine) end
local existed = redis.call('EXISTS', KEYS[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[5])
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5]) end
redis.call('SADD', KEYS[4], ARGV[1])
return existed
"""

# KEYS: epoch, prefixes, prefix_epoch, events, generation, workers.
# ARGV: worker id, epoch, reset, n_inserted, n_evicted, event, maxlen, prefix-key prefix,
#       generation candidate, inserted hashes..., evicted hashes...
# Returns the event's stream id, or -1 when fenced.
APPLY_INDEX = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[2])
if cur > mine then return -1 end
if cur < mine then redis.call('SET', KEYS[1], mine) end
redis.call('SET', KEYS[5], ARGV[9], 'NX')
redis.call('SADD', KEYS[6], ARGV[1])
local pfx = ARGV[8]
local held_epoch = tonumber(redis.call('GET', KEYS[3]) or '-1')
if ARGV[3] == '1' or held_epoch ~= mine then
  for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('HDEL', pfx .. h, ARGV[1]) end
  redis.call('DEL', KEYS[2])
  redis.call('SET', KEYS[3], mine)
end
local ni = tonumber(ARGV[4])
local ne = tonumber(ARGV[5])
for i = 1, ne do
  local h = ARGV[9 + ni + i]
  redis.call('HDEL', pfx .. h, ARGV[1])
  redis.call('SREM', KEYS[2], h)
end
for i = 1, ni do
  local h = ARGV[9 + i]
  redis.call('HSET', pfx .. h, ARGV[1], mine)
  redis.call('SADD', KEYS[2], h)
end
return redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
"""

# KEYS: epoch, info, load, prefixes, prefix_epoch, workers, events.
# ARGV: worker id, epoch, mode ('deregister' | 'expired'), event, maxlen, prefix-key prefix.
# Returns 1 when purged, 0 when the worker is alive (mode 'expired'), -1 on epoch mismatch.
PURGE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[3] == 'expired' and redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if cur ~= tonumber(ARGV[2]) then return -1 end
local pfx = ARGV[6]
for _, h in ipairs(redis.call('SMEMBERS', KEYS[4])) do redis.call('HDEL', pfx .. h, ARGV[1]) end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
redis.call('SREM', KEYS[6], ARGV[1])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[4])
return 1
"""

# KEYS: workers, events, generation. ARGV: worker-key prefix.
# Atomic, so the holdings are exactly the state after the returned stream id.
SNAPSHOT = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local out = {redis.call('GET', KEYS[3]) or '', '0-0'}
if #last > 0 then out[2] = last[1][1] end
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local e = redis.call('GET', ARGV[1] .. w .. ':prefix_epoch')
  if e then
    table.insert(out, w)
    table.insert(out, e)
    table.insert(out, redis.call('SMEMBERS', ARGV[1] .. w .. ':prefixes'))
  end
end
return out
"""
