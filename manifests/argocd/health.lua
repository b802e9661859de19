-- Argo CD health check for reportsserver.io/ReportsServer.
-- Progressing until the operator has observed the current generation; then Degraded when
-- Degraded (or Stalled) is True, Healthy when Ready is True, Progressing otherwise.
local hs = { status = "Progressing", message = "Waiting for the operator" }
if obj.status == nil then
  return hs
end
if obj.status.observedGeneration == nil or obj.metadata.generation == nil
    or obj.status.observedGeneration < obj.metadata.generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(obj.metadata.generation)
  return hs
end
local ready, degraded
for _, c in ipairs(obj.status.conditions or {}) do
  if c.type == "Ready" then ready = c end
  if (c.type == "Degraded" or c.type == "Stalled") and c.status == "True" then degraded = c end
end
if degraded ~= nil then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "") .. ": " .. (degraded.message or "")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end
if ready ~= nil then
  hs.message = (ready.reason or "") .. ": " .. (ready.message or "")
end
return hs
