"""`radixserve bench`: scenario workloads run against cold servers (or any OpenAI-compatible
URL) over HTTP only, reported as JSON, Markdown and PNG. See docs/BENCHMARKS.md.

Modules: scenarios (JSON -> prompts), client (streaming requests), server_proc (start/stop a
server, sample its RSS), modes (flags per cache mode), runner (phases), stats (figures),
report (outputs), cli (arguments).
"""
