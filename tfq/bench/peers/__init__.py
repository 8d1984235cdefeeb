"""The bench's peers, each in a child process of its own: parent_end.py is tfq's end of the pipe, child_end.py the
child's; hf.py, llama.py and ik_llama.py the engines the child runs; choice.py which peer and where;
llama_server.py the peer of `tfq bench serve`."""
