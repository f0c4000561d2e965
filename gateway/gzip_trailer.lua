-- Gzip request bodies, part 1 of 2: before the decompressor, note what the
-- compressed body says about itself, as it streams past (never buffered here, so a
-- small bomb is inflated chunk by chunk and the buffer filter's limit stops it).
--
-- Envoy's decompressor passes on whatever zlib produced, with no word of a
-- truncated or corrupt stream; gzip_verify.lua, after it, compares the inflated
-- body with the member's own trailer (RFC 1952: CRC-32 and length mod 2^32).

local META = "encoderd.gzip"

-- The unsigned little-endian 32-bit field of `bytes` at 1-based `at`.
local function le32(bytes, at)
  local a, b, c, d = bytes:byte(at, at + 3)
  return a + b * 256 + c * 65536 + d * 16777216
end

function envoy_on_request(handle)
  if handle:headers():get("content-encoding") ~= "gzip" then return end
  local head, tail, size = "", "", 0
  local function note()  -- numbers and hex: metadata values are protobuf strings, not bytes
    local meta = handle:streamInfo():dynamicMetadata()
    meta:set(META, "head", (head:gsub(".", function(c) return string.format("%02x", c:byte()) end)))
    meta:set(META, "size", size)
    if #tail == 8 then
      meta:set(META, "crc", le32(tail, 1))
      meta:set(META, "isize", le32(tail, 5))
    end
  end
  note()
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if #head < 3 then head = head .. chunk:getBytes(0, math.min(n, 3 - #head)) end
    local last = math.min(n, 8)
    tail = (tail .. chunk:getBytes(n - last, last)):sub(-8)
    size = size + n
    note()
  end
end
