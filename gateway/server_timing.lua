-- Successful REST calls: where the call's time went (tokenize, queue, compute, total;
-- server/scheduling/timing.py) comes from the server as a gRPC trailer, which the transcoder
-- drops; it is moved into the response's Server-Timing header, where HTTP clients and browsers'
-- developer tools read it. After the transcoder in the chain, so this sees the gRPC response
-- before it does. Waiting for the trailer holds the answer here until it is whole, as the
-- transcoder holds a unary answer anyway (it sets its content-length).

function envoy_on_response(handle)
  local headers = handle:headers()
  if (headers:get("content-type") or ""):sub(1, 16) ~= "application/grpc" or headers:get("grpc-status") then
    return -- not from the server, or an error (trailers-only): no timing
  end
  handle:body() -- held whole (headers can change only while they are held too), then its trailers
  local trailers = handle:trailers()
  local timing = trailers and trailers:get("server-timing")
  if timing then handle:headers():replace("server-timing", timing) end
end
