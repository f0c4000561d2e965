-- CORS preflights (--cors-allow-origin): the CORS filter after this one answers them with the
-- policy's fixed Access-Control-Allow-Headers, and a browser SDK asking for its own headers
-- (openai-node's x-stainless-*, cohere-ts' x-fern-*) was refused its call. For an origin the
-- policy allows (its answer carries Access-Control-Allow-Origin) the headers asked for are
-- allowed: a page of an allowed origin may send any header, as the server reads only its own.
-- Other origins still get no CORS headers at all.

local META = "encoderd.cors"

function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get(":method") ~= "OPTIONS" then return end
  local asked = headers:get("access-control-request-headers")
  if asked then
    -- Header names are tokens: anything else is dropped rather than echoed into a response header.
    handle:streamInfo():dynamicMetadata():set(META, "asked", (asked:gsub("[^%w!#$%%&'*+%-.^_`|~,%s]", "")))
  end
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(META)
  if not meta then return end
  local headers = handle:headers()
  if headers:get("access-control-allow-origin") then
    headers:replace("access-control-allow-headers", meta.asked)
  end
end
