"""Text: what turns a request into token ids and a reply back into a message.

- tokenizer.py: the GGUF's own tokenizer, as llama.cpp builds it (pre-tokenizer regexes per
  `tokenizer.ggml.pre` in pretokenize.py);
- chat_template.py: the model's Jinja chat template, rendered as llama.cpp renders it;
- chat_format.py: OpenAI tools and reasoning for a chat request (its prompt, its grammar and how
  to read the reply), from the template's capabilities and minja's polyfills (chat_caps.py);
- chat_parse.py: replies parsed into content / reasoning_content / tool_calls, also while they
  stream (partial_json.py reads JSON cut anywhere);
- grammar.py: GBNF, Lark and JSON schemas -> llguidance grammars and per-sequence token masks.

This room imports nothing from radixserve.model or radixserve.sampling: both import it (the
loader for the tokenizer and the template, the sampler chain for a grammar's Constraint).
"""
