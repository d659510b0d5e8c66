"""One file_system tree (run by test_file_system.py): the parent sets the strategy, a
child (spawn or forkserver, argv[1]) gets tensors by name, writes into them and sends
one of its own back."""
import json
import multiprocessing
import os
import sys

import multiproc as mp


def tree_names(tag):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("multiproc_") and n.endswith(tag))


def child(t, q_in, q_out):
    got = q_in.get()
    t += 1
    got += 1
    mine = mp.full((2000,), 7.0)
    q_out.put((os.getpid(), mine))
    q_in.get()  # the parent has looked at the names


if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    addr = os.environ["MULTIPROC_SHM_MANAGER"]
    _, _, uid, root, start, rnd = addr.split("-")
    tag = f"_{root}_{start}_{rnd}"
    ctx = multiprocessing.get_context(sys.argv[1])
    arg, sent = mp.full((1 << 18,), 1.0), mp.full((1000,), 2.0)
    named = tree_names(tag)
    assert any(n.startswith(f"multiproc_{os.getpid()}_") for n in named), named
    q_in, q_out = mp.Queue(), mp.Queue()
    p = ctx.Process(target=child, args=(arg, q_in, q_out))
    p.start()
    q_in.put(sent)
    pid, theirs = q_out.get(timeout=60)
    assert float(theirs.sum()) == 7.0 * 2000
    assert any(n.startswith(f"multiproc_{pid}_") for n in tree_names(tag)), tree_names(tag)
    q_in.put(None)
    p.join(60)
    assert p.exitcode == 0
    assert float(arg[0]) == 2.0 and float(sent[0]) == 3.0
    print(json.dumps({"addr": addr, "tag": tag, "names": len(tree_names(tag))}))
