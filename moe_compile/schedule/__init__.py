"""Cost models, profiler, r solver and simulator (issue: chunked pipelining)."""
