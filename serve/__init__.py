"""`python -m serve.run`: the OpenAI-compatible HTTP server. One job per module:

  run         command line, start-up (load, warm-up), uvicorn
  api         HTTP routes, validation, SSE (protocol: the OpenAI request/response shapes)
  engine      the engine thread: one iteration = prefill chunk + decode step + delivery
  scheduler   slots, the waiting queue, the next prefill chunk (host only, no JAX)
  runner      the device side: slots, compiled prefill chunk and step, results one step late
  output      tokens -> text, stop strings, stop tokens, max_tokens (tokenizer: text <-> ids)
  metrics     Prometheus; profiler: JAX traces; bench: the load-generating client
"""
