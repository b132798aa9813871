-- wrk script: count responses by status in every thread and print the totals at the end.
-- WRK_BODY (a JSON request) makes each request a POST to the URL with that body.
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  counts = {}
  local body = os.getenv("WRK_BODY")
  if body and #body > 0 then
    wrk.method = "POST"
    wrk.body = body
    wrk.headers["Content-Type"] = "application/json"
  end
  wrk.headers["Connection"] = "close"
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("counts")) do
      total[status] = (total[status] or 0) + n
    end
  end
  local line = "statuses:"
  for status, n in pairs(total) do
    line = line .. " " .. status .. "=" .. n
  end
  print(line)
  local e = summary.errors
  print(string.format("socket errors: connect=%d read=%d write=%d timeout=%d; http errors (status > 399)=%d",
    e.connect, e.read, e.write, e.timeout, e.status))
end
