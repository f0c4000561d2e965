-- REST responses, as OpenAI / Cohere clients expect them.
--
-- Every error leaves Envoy as {"error":{"message","type","param","code"}} with
-- the HTTP status the transcoder chose from the gRPC status, whatever made it:
-- the server (a google.rpc.Status JSON, convert_grpc_status), the transcoder
-- (plain text such as `Unexpected end of string`), or Envoy itself (413,
-- 503 `upstream connect error`, 504 `upstream request timeout`). gRPC plumbing
-- headers never reach REST clients. Native gRPC passing through is untouched.

local GRPC_CODES = {
  [1] = "cancelled", [2] = "unknown", [3] = "invalid_argument", [4] = "deadline_exceeded",
  [5] = "not_found", [6] = "already_exists", [7] = "permission_denied", [8] = "resource_exhausted",
  [9] = "failed_precondition", [10] = "aborted", [11] = "out_of_range", [12] = "unimplemented",
  [13] = "internal", [14] = "unavailable", [15] = "data_loss", [16] = "unauthenticated",
}

-- For errors Envoy makes itself, which carry no gRPC code.
local HTTP_CODES = {
  [400] = "invalid_argument", [401] = "unauthenticated", [403] = "permission_denied",
  [404] = "not_found", [405] = "method_not_allowed", [408] = "request_timeout", [413] = "payload_too_large",
  [415] = "unsupported_media_type",
  [429] = "resource_exhausted", [431] = "headers_too_large", [500] = "internal",
  [501] = "unimplemented", [502] = "unavailable", [503] = "unavailable", [504] = "deadline_exceeded",
}

-- The OpenAI `type` field; the SDKs pick their exception class from the status.
local TYPES = {
  [401] = "authentication_error", [403] = "permission_error", [404] = "not_found_error",
  [429] = "rate_limit_error", [503] = "service_unavailable", [504] = "timeout_error",
}

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t' }

-- A run of bytes >= 0x80 with every byte that is not part of a well-formed
-- UTF-8 sequence replaced by U+FFFD, so the JSON stays valid whatever Envoy echoed.
local function repair_utf8(run)
  local out, i = {}, 1
  while i <= #run do
    local lead = run:byte(i)
    local extra = (lead >= 194 and lead <= 223 and 1) or (lead >= 224 and lead <= 239 and 2)
                  or (lead >= 240 and lead <= 244 and 3) or 0
    local tail = run:sub(i + 1, i + extra)
    if extra > 0 and #tail == extra and not tail:find("[^\128-\191]") then
      out[#out + 1] = run:sub(i, i + extra)
      i = i + extra + 1
    else
      out[#out + 1] = "\\ufffd"
      i = i + 1
    end
  end
  return table.concat(out)
end

-- Every error message a REST client gets is at most this many bytes of JSON literal, whoever made
-- it (the server's are cut at 2,048 bytes already; the transcoder's and Envoy's own may quote what
-- the client sent): its first part, then a word that it was cut.
local MESSAGE_BYTES = 4096

-- A JSON string literal (quotes included) of at most about MESSAGE_BYTES, cut before an escape or
-- a UTF-8 sequence it would split.
local function bounded(literal)
  if #literal <= MESSAGE_BYTES then return literal end
  local cut, pos = MESSAGE_BYTES, 2
  while true do
    local at = literal:find("\\", pos, true)
    if not at or at >= MESSAGE_BYTES then break end
    local after = at + (literal:sub(at + 1, at + 1) == "u" and 6 or 2)
    if after > MESSAGE_BYTES then cut = at; break end
    pos = after
  end
  while literal:byte(cut) >= 128 and literal:byte(cut) < 192 do cut = cut - 1 end
  return literal:sub(1, cut - 1) .. " ... (message cut)\""
end

-- A JSON string literal of any text.
local function json_string(text)
  text = text:sub(1, MESSAGE_BYTES + 1) -- bounded() cuts it; a split UTF-8 tail becomes U+FFFD
  local escaped = text:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or string.format("\\u%04x", c:byte())
  end)
  return '"' .. escaped:gsub("[\128-\255]+", repair_utf8) .. '"'
end

-- The raw JSON literal of `"message"` in a google.rpc.Status body: it is already
-- escaped by the transcoder, so it is copied, never decoded and re-encoded.
local function status_message_literal(body)
  local _, open = body:find('"message":"', 1, true)
  if not open then return nil end
  local pos = open + 1
  while true do
    local at = body:find('["\\]', pos)
    if not at then return nil end
    if body:sub(at, at) == '"' then return body:sub(open, at) end
    pos = at + 2 -- skip the escaped character
  end
end

local function percent_decode(text)
  return (text:gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

-- `grpc` holds the grpc-status / grpc-message headers, read before the body was
-- buffered (buffering invalidates the header object the script held).
local function error_body(status, grpc, body_text)
  local code, message
  if body_text:sub(1, 8) == '{"code":' then
    code = GRPC_CODES[tonumber(body_text:match('^{"code":(%d+)'))]
    message = status_message_literal(body_text)
  elseif #body_text > 0 then
    message = json_string(body_text)
  end
  if not message and grpc.message then message = json_string(percent_decode(grpc.message)) end
  code = code or GRPC_CODES[tonumber(grpc.status or "")] or HTTP_CODES[status] or "error"
  if not message or message == '""' then message = json_string("HTTP " .. status .. " (" .. code .. ")") end
  message = bounded(message)
  local kind = TYPES[status] or (status >= 500 and "server_error" or "invalid_request_error")
  return '{"error":{"message":' .. message .. ',"type":"' .. kind .. '","param":null,"code":"' .. code .. '"}}'
end

function envoy_on_response(handle)
  local headers = handle:headers()
  if (headers:get("content-type") or ""):sub(1, 16) == "application/grpc" then return end
  local status = tonumber(headers:get(":status")) or 500
  local grpc = { status = headers:get("grpc-status"), message = headers:get("grpc-message") }
  local retry_after = headers:get("retry-after") -- the server's estimate, where it refused by expected wait
  headers:remove("grpc-status")
  headers:remove("grpc-message")
  headers:remove("grpc-accept-encoding")
  -- HEAD (marked by the request filter before this one): the status and headers say it all.
  if status < 400 or handle:streamInfo():dynamicMetadata():get("encoderd.head") then return end
  local body = handle:body(true)
  local json = error_body(status, grpc, body:length() > 0 and body:getBytes(0, body:length()) or "")
  body:setBytes(json)
  headers = handle:headers()
  -- Overload and loading / restarting are temporary: say when to come back (RFC 9110 Retry-After).
  if status == 429 or status == 503 then headers:replace("retry-after", retry_after or "1") end
  headers:replace("content-type", "application/json")
  headers:replace("content-length", tostring(#json))
end
