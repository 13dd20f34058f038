"""Router mode (llama-server's): a server with no model of its own that runs one child
`radixserve serve` per loaded model and proxies each request to the child of the model it
names. registry.py: the models and their states; children.py: the child processes; app.py:
the HTTP app."""
