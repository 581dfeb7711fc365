"""The HistoryStore's SQL: conversations, turns, attachments and compactions.

Named statements apart from the methods that run them, so store.py reads as its
transactions. The knowledge-base statements live in kb.py and the search ones in
search.py, each beside the only code that uses them.
"""

# A conversation's turns are numbered 1, 2, ... (``start_turn`` numbers the next one this
# count plus one) and never deleted one by one, so the highest number is the count: one
# index seek, where count(*) walks every turn of the conversation, on every turn's way to
# the model and per row of a listing.
CONVERSATION_SELECT = """
SELECT c.id, c.title, c.model, c.system_prompt, c.settings, c.ctx_used, c.created_at, c.updated_at,
       coalesce((SELECT max(t.turn) FROM turns AS t WHERE t.conversation_id = c.id), 0) AS turn_count
FROM conversations AS c
"""
SELECT_CONVERSATION = CONVERSATION_SELECT + "WHERE c.id = ? AND c.deleted_at IS NULL"
# id breaks ties between equal timestamps; the updated_at index already ends in rowid.
LIST_ORDER = "ORDER BY c.updated_at DESC, c.id DESC LIMIT ?"
LIST_CONVERSATIONS = CONVERSATION_SELECT + "WHERE c.deleted_at IS NULL " + LIST_ORDER
LIST_CONVERSATIONS_BEFORE = (
    CONVERSATION_SELECT
    + "WHERE c.deleted_at IS NULL AND c.updated_at < ? "
    + LIST_ORDER
)
IS_LIVE_CONVERSATION = "SELECT 1 FROM conversations WHERE id = ? AND deleted_at IS NULL"
DELETED_BUT_INDEXED = """
SELECT c.id FROM conversations AS c
WHERE c.deleted_at IS NOT NULL
  -- its search rows' rowid range (fts.conversation_rowid_range)
  AND EXISTS (SELECT 1 FROM message_fts WHERE rowid BETWEEN c.id << 32 AND (c.id << 32) | 4294967295)
ORDER BY c.id
"""
INSERT_CONVERSATION = """
INSERT INTO conversations (title, model, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?, ?)
"""
TOUCH_CONVERSATION = "UPDATE conversations SET updated_at = ? WHERE id = ?"
FINISH_CONVERSATION = """
UPDATE conversations SET ctx_used = coalesce(?, ctx_used), updated_at = ? WHERE id = ?
"""
UPDATE_CONVERSATION = """
UPDATE conversations SET title = ?, model = ?, system_prompt = ?, settings = ? WHERE id = ?
"""
REPLACE_TITLE = """
UPDATE conversations SET title = ? WHERE id = ? AND title = ? AND deleted_at IS NULL
"""
SOFT_DELETE_CONVERSATION = """
UPDATE conversations SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL
"""

TURN_COLUMNS = """
t.conversation_id, t.turn, t.text, t.files, t.messages, t.reply, t.status, t.error,
t.error_code, t.finish_reason, t.model, t.prompt_tokens, t.completion_tokens,
t.created_at, t.updated_at, t.sources, t.ref, t.approvals
"""
SELECT_TURNS = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY t.turn
"""
# a page of turns: ``open`` with ``from_turn``/``limit`` (the primary key's order)
SELECT_TURN_RANGE = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn >= ? AND c.deleted_at IS NULL
ORDER BY t.turn
LIMIT ?
"""
SELECT_TURN = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn = ? AND c.deleted_at IS NULL
"""
# The row itself whatever became of its conversation: a turn still finishes (and is
# returned to the daemon) when its conversation was deleted while it ran.
SELECT_TURN_ROW = f"""
SELECT {TURN_COLUMNS} FROM turns AS t WHERE t.conversation_id = ? AND t.turn = ?
"""
# A video's text is one line saying its duration and size (attachments/video.py), which the
# manifest of folded files repeats; other texts stay unread until one attachment is asked for.
ATTACHMENT_COLUMNS = """
a.id, a.conversation_id, a.turn, a.name, a.path, a.kind, a.content_type, a.size_bytes,
a.sha256, a.pages, a.created_at, a.full_text IS NOT NULL AND a.full_text != '' AS has_text,
CASE WHEN a.kind IN ('video', 'audio') THEN a.full_text END AS video_line
"""
# Joined to the conversation so a deleted conversation's files are gone too.
LIST_ATTACHMENTS = f"""
SELECT {ATTACHMENT_COLUMNS}
FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
WHERE a.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY a.id
"""
HAS_ATTACHMENTS = """
SELECT EXISTS (
    SELECT 1 FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
    WHERE a.conversation_id = ? AND c.deleted_at IS NULL
)
"""
SELECT_ATTACHMENT = f"""
SELECT {ATTACHMENT_COLUMNS}, a.full_text
FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
WHERE a.conversation_id = ? AND a.id = ? AND c.deleted_at IS NULL
"""
INSERT_ATTACHMENT = """
INSERT INTO attachments (conversation_id, turn, name, path, kind, content_type, size_bytes,
                         sha256, pages, full_text, created_at, sent_whole)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""

# What a prompt replays: the turns after a compaction's last one that got a reply. A turn
# without any (an error before the first word) is left out: a question without an answer
# would break the alternation of roles many chat templates require.
SELECT_ANSWERED_TURNS = """
SELECT t.turn, t.messages FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn > ? AND t.turn < ? AND t.reply != ''
  AND c.deleted_at IS NULL
ORDER BY t.turn
"""

INSERT_TURN = """
INSERT INTO turns (conversation_id, turn, text, files, messages, status, model,
                   created_at, updated_at, ref)
VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)
"""
# Only a running turn takes checkpoints: a late one must not overwrite a final reply.
SAVE_PARTIAL = """
UPDATE turns SET reply = ? WHERE conversation_id = ? AND turn = ? AND status = 'running'
"""
FINISH_TURN = """
UPDATE turns
SET messages = ?, reply = ?, status = ?, finish_reason = ?, error = ?, error_code = ?,
    prompt_tokens = ?, completion_tokens = ?, sources = ?, approvals = ?, updated_at = ?
WHERE conversation_id = ? AND turn = ?
"""
SELECT_RUNNING = "SELECT conversation_id, turn, messages, reply FROM turns WHERE status = 'running'"
SELECT_TURN_MESSAGES = "SELECT messages FROM turns WHERE conversation_id = ? AND turn = ?"
SET_TURN_MESSAGES = "UPDATE turns SET messages = ? WHERE conversation_id = ? AND turn = ?"
# new text: its recall chunks are made again (history/archive.py), and the question did not carry it
SET_ATTACHMENT_TEXT = """
UPDATE attachments SET full_text = ?, chunked = 0, sent_whole = 0 WHERE conversation_id = ? AND turn = ? AND sha256 = ?
"""
INTERRUPT_TURN = """
UPDATE turns SET status = 'interrupted', messages = ?, updated_at = ?
WHERE conversation_id = ? AND turn = ?
"""

INSERT_COMPACTION = """
INSERT INTO compactions (conversation_id, through_turn, summary, created_at)
VALUES (?, ?, ?, ?)
"""
SELECT_COMPACTION_TURNS = "SELECT through_turn FROM compactions WHERE conversation_id = ?"
SELECT_LATEST_COMPACTION = """
SELECT k.id, k.conversation_id, k.through_turn, k.summary, k.created_at
FROM compactions AS k JOIN conversations AS c ON c.id = k.conversation_id
WHERE k.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY k.through_turn DESC, k.id DESC
LIMIT 1
"""
SELECT_TURN_EXISTS = "SELECT 1 FROM turns WHERE conversation_id = ? AND turn = ?"

# The OpenAI door's threads (migrations.m011_threads): the newest live conversation the
# digest names that has had no turn since.
SELECT_THREAD = """
SELECT h.conversation_id FROM threads AS h JOIN conversations AS c ON c.id = h.conversation_id
WHERE h.digest = ? AND c.deleted_at IS NULL
  AND h.turns = (SELECT max(t.turn) FROM turns AS t WHERE t.conversation_id = c.id)
ORDER BY h.conversation_id DESC LIMIT 1
"""
INSERT_THREAD = "INSERT OR REPLACE INTO threads (digest, conversation_id, turns) VALUES (?, ?, ?)"
# An import the question it was made for never joined (HistoryStore.discard_import): its turns,
# how many of them were imported, and the rows that go with it.
COUNT_IMPORTED = """
SELECT count(*), coalesce(sum(finish_reason = ?), 0) FROM turns WHERE conversation_id = ?
"""
# The messages of a conversation's last turn when it ended on calls to a client's own tools.
SELECT_WAITING_TURN = """
SELECT messages FROM turns WHERE conversation_id = ? AND status = 'complete' AND finish_reason = 'tool_calls'
  AND turn = (SELECT max(t.turn) FROM turns AS t WHERE t.conversation_id = ?)
"""
DELETE_THREADS = "DELETE FROM threads WHERE conversation_id = ?"
DELETE_TURNS = "DELETE FROM turns WHERE conversation_id = ?"
DELETE_CONVERSATION = "DELETE FROM conversations WHERE id = ?"
# A turn that ended on calls to a client's own tools, taken up again with their results: the
# conversation's last turn, and only such a one.
REOPEN_TURN = """
UPDATE turns SET status = 'running', finish_reason = NULL, updated_at = ?
WHERE conversation_id = ? AND status = 'complete' AND finish_reason = 'tool_calls'
  AND turn = (SELECT max(t.turn) FROM turns AS t WHERE t.conversation_id = ?)
RETURNING turn
"""
