"""One file_system tree (run by test_file_system.py): the parent sets the strategy, a
child (spawn or forkserver, argv[1]) gets tensors by name, writes into them and sends
one of its own back."""
import json
import multiprocessing
import os
import sys

import multiproc as mp


def tree_names(root):
    """The names of the tree rooted at ``root``, and who made each."""
    return sorted((n, creator) for n, creator, tree in mp.shm_segments()
                  if tree is not None and tree[0] == root)


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
    root = os.getpid()  # this program starts a fresh tree
    ctx = multiprocessing.get_context(sys.argv[1])
    arg, sent = mp.full((1 << 18,), 1.0), mp.full((1000,), 2.0)
    named = tree_names(root)
    assert any(creator == root for _, creator in named), named
    q_in, q_out = mp.Queue(), mp.Queue()
    p = ctx.Process(target=child, args=(arg, q_in, q_out))
    p.start()
    q_in.put(sent)
    pid, theirs = q_out.get(timeout=60)
    assert float(theirs.sum()) == 7.0 * 2000
    assert any(creator == pid for _, creator in tree_names(root)), tree_names(root)
    q_in.put(None)
    p.join(60)
    assert p.exitcode == 0
    assert float(arg[0]) == 2.0 and float(sent[0]) == 3.0
    print(json.dumps({"addr": addr, "root": root, "names": len(tree_names(root))}))
