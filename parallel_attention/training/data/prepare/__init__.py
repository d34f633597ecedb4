"""Preparation: a corpus tokenized once, streaming, into shards a run reads (data format 2).

`corpus` and `corpus_formats` read the documents and count what they skip, `encoding` tokenizes them, `shards` writes
Megatron-LM indexed shards and meta.json, working in `partial_output` (`.NAME.partial/`, from which a killed
preparation resumes) and reporting through `progress`; `run_data_dir` prepares a run's data.data_dir once. Nothing
here imports the read wing.
"""
