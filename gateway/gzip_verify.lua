-- Gzip request bodies, part 2 of 2: after the decompressor and the buffer filter,
-- the whole inflated body must match the trailer gzip_trailer.lua kept (CRC-32
-- and length), else 400 before anything reaches the transcoder: a truncated or
-- corrupt stream inflates to a prefix, or to nothing, which is no request at all.

local META = "encoderd.gzip"
local band, bxor, bnot, rshift, tobit = bit.band, bit.bxor, bit.bnot, bit.rshift, bit.tobit

-- CRC-32 (the reflected 0xEDB88320 polynomial of gzip), one table lookup a byte.
local CRC_TABLE = {}
for n = 0, 255 do
  local c = n
  for _ = 1, 8 do
    c = band(c, 1) == 1 and bxor(0xEDB88320, rshift(c, 1)) or rshift(c, 1)
  end
  CRC_TABLE[n] = c
end

local function crc32(text)
  local crc, byte = bnot(0), string.byte
  for i = 1, #text do
    crc = bxor(rshift(crc, 8), CRC_TABLE[band(bxor(crc, byte(text, i)), 0xFF)])
  end
  return bnot(crc)
end

local function refuse(handle, text)
  -- plain text: errors.lua makes it the JSON error body
  handle:respond({[":status"] = "400", ["content-type"] = "text/plain"},
    text .. ": send a complete gzip stream (one member) or the JSON uncompressed")
end

function envoy_on_request(handle)
  if not handle:streamInfo():dynamicMetadata():get(META) then return end
  local body = handle:body()
  local meta = handle:streamInfo():dynamicMetadata():get(META)  -- as the last chunk left it
  local size = tonumber(meta.size) or 0
  if size == 0 then return end  -- no body at all, whatever Content-Encoding says: nothing to inflate
  if size < 18 then  -- 10-byte header, an empty deflate block, 8-byte trailer
    return refuse(handle, "the gzip body is truncated (" .. size .. " bytes; a gzip stream has at least 18)")
  end
  if meta.head ~= "1f8b08" then
    return refuse(handle, "the body is not gzip (Content-Encoding: gzip, but no gzip header)")
  end
  local length = body and body:length() or 0
  local text = length > 0 and body:getBytes(0, length) or ""
  if tobit(length) ~= tobit(meta.isize) or crc32(text) ~= tobit(meta.crc) then
    return refuse(handle, "the gzip body is truncated or corrupt (its length or CRC-32 does not match " ..
      "what it inflates to)")
  end
end
