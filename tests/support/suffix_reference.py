"""A brute-force reference for suffix decoding's tree: counts and drafts found by scanning the
sequences, and the tree's own paths spelt out, for tests to compare."""

from kunlun_runtime.engine.suffix_tree import draft_limit


def occurrences(sequences, path):
    return sum(
        1
        for sequence in sequences
        for start in range(len(sequence) - len(path) + 1)
        if sequence[start : start + len(path)] == path
    )


def continuations(sequences, path, max_depth):
    """token → how often it followed ``path``, in the order of first occurrence."""
    found = {}
    if len(path) >= max_depth:
        return found
    for sequence in sequences:
        for start in range(len(sequence) - len(path)):
            if sequence[start : start + len(path)] == path:
                token = sequence[start + len(path)]
                found[token] = found.get(token, 0) + 1
    return found


def reference_draft(sequences, context, max_depth, k, factor, min_prob):
    """(tokens, score, match length) by scanning: the longest suffix of the context followed by
    something, then the most frequent continuation while the probability product holds."""
    lengths = range(min(len(context), max_depth - 1), 0, -1)
    match = next((m for m in lengths if continuations(sequences, list(context[-m:]), max_depth)), 0)
    if match == 0:
        return (), 0.0, 0
    path, draft, score, probability = list(context[-match:]), [], 0.0, 1.0
    while len(draft) < draft_limit(k, factor, match):
        following = continuations(sequences, path, max_depth)
        if not following:
            break
        token = max(following, key=following.get)
        probability *= following[token] / occurrences(sequences, path)
        if probability < min_prob:
            break
        draft.append(token)
        score += probability
        path.append(token)
    return tuple(draft), score, match


def path_counts(tree):
    """Every path the tree holds (tails spelt out) → its count."""
    counts = {}
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        if node.children is None:  # a tail: one occurrence, spelt out by its sequence
            sequence = tree._sequences[node.seq_id]
            at = node.start + node.depth
            counts[path] = 1
            while len(path) < tree.max_depth and at < len(sequence):
                path, at = (*path, sequence[at]), at + 1
                counts[path] = 1
            continue
        if path:
            counts[path] = node.count
        stack.extend((child, (*path, token)) for token, child in node.children.items())
    return counts


def substring_counts(sequences, max_depth):
    counts = {}
    for sequence in sequences:
        for start in range(len(sequence)):
            for end in range(start + 1, min(start + max_depth, len(sequence)) + 1):
                key = tuple(sequence[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def count_nodes(tree):
    stack, total = [tree.root], 0
    while stack:
        node = stack.pop()
        total += 1
        stack.extend((node.children or {}).values())
    return total
