// The server panel: /metrics polled while the page is visible.

import { $ } from "./dom.js";

const METRICS_INTERVAL_MS = 1000;

/** The samples of a Prometheus text page, summed by name over their labels. */
function parsePrometheus(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) values.set(m[1], (values.get(m[1]) || 0) + Number(m[2]));
  }
  return values;
}

export async function pollMetrics() {
  if (document.visibilityState === "visible") {
    try {
      const response = await fetch("/metrics", { cache: "no-store" });
      if (response.ok) showMetrics(parsePrometheus(await response.text()));
    } catch {
      // the server is away; keep the last figures
    }
  }
  setTimeout(pollMetrics, METRICS_INTERVAL_MS);
}

function showMetrics(values) {
  const get = (name) => values.get(`kvserve:${name}`);
  const running = get("num_requests_running");
  const waiting = get("num_requests_waiting");
  const usage = get("kv_cache_usage_perc");
  const hits = get("prefix_cache_hits_total");
  const queries = get("prefix_cache_queries_total");
  $("metric-running").textContent = running === undefined ? "–" : String(running);
  $("metric-waiting").textContent = waiting === undefined ? "–" : String(waiting);
  $("metric-kv").textContent = usage === undefined ? "–" : `${(usage * 100).toFixed(1)}%`;
  $("metric-prefix").textContent = queries ? `${((100 * hits) / queries).toFixed(1)}%` : "–";
}
