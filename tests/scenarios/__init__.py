"""End-to-end scenarios on real vLLM. Each runs as its own process (vLLM keeps process-global state),
started by ``conftest.run_script``, and prints one JSON result line for the tests to read."""
