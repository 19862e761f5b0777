/* The rings in C: Ring and Inbox as in s2s_flow/rings.py, and the GIL hand-over they
 * sleep and wake with.
 *
 * rings.py is the reference and the stand-in where this is not built: tests/test_rings.py
 * runs every behaviour test on both, and tests/test_rings_c.py holds them to the same
 * results op by op. This file exists for speed. A hop is a wait, a put and a wake-up; run
 * in Python, on caches that the thread switch before them left cold, they took some 9 of
 * the 13.5 us a pass-through node spent per message (measured on the paced benchmark).
 *
 * The hand-over. A Python thread that wakes another still holds the GIL; the woken thread
 * finds the GIL taken, sleeps again on it, and is woken a second time when the first one
 * blocks: two thread switches per hop instead of one. So a node does not wake its
 * consumers when it puts (``deferred``): block(waiter, wakes, timeout) drops the GIL,
 * releases every waiter in ``wakes`` (emptying the list), then waits on ``waiter``, and the
 * woken threads find the GIL free. wake_now(wakes) does the release alone, for a thread
 * that goes on running (a stream that hands over each item as it is made). A Waiter is a
 * one-shot lock, created locked; release() unlocks it once, and once woken it stays woken.
 * A signal interrupts a wait so that its handler runs (main thread).
 *
 * Locking is the same as in rings.py: each Inbox has one lock, shared by every ring into
 * it. It is held only by C code here, except while flush() asks ``stale`` about each item;
 * a thread that finds it taken waits for it without the GIL. Nothing under the lock can
 * run Python code of its own accord: items that leave a ring are let go of (DECREF) and
 * the lists handed out are built after the lock is released.
 *
 * setup(RingStats, RingClosed) is called once by rings.py: the class stats() returns and
 * the exception a put on a closed ring raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#define STACK_WAKES 16

static PyObject *RingStats, *RingClosed;  /* from setup() */

/* Monotonic time as time.monotonic() reads it (3.13 made the clock public; before, only
 * the underscored name). */
static long long monotonic_ns(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_MonotonicRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetMonotonicClock();
#endif
}

static double monotonic(void) { return (double)monotonic_ns() / 1e9; }

/* -- Waiter ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int released;
} Waiter;

static PyTypeObject WaiterType;

static Waiter *waiter_create(void) {
    Waiter *self = PyObject_New(Waiter, &WaiterType);
    if (self == NULL)
        return NULL;
    self->released = 0;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        self->released = 1;
        Py_DECREF(self);
        PyErr_NoMemory();
        return NULL;
    }
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    return self;
}

static PyObject *Waiter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Waiter() takes no arguments");
        return NULL;
    }
    return (PyObject *)waiter_create();
}

static void Waiter_dealloc(Waiter *self) {
    if (self->lock != NULL) {
        if (!self->released)
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    PyObject_Free(self);
}

static void waiter_release(Waiter *self) {
    if (!self->released) {
        self->released = 1;
        PyThread_release_lock(self->lock);
    }
}

static PyObject *Waiter_release(Waiter *self, PyObject *unused) {
    waiter_release(self);
    Py_RETURN_NONE;
}

static PyMethodDef Waiter_methods[] = {
    {"release", (PyCFunction)Waiter_release, METH_NOARGS, "Wake the thread sleeping on this waiter (once)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "s2s_flow._rings.Waiter",
    .tp_doc = "A one-shot lock a sleeping thread waits on; release() wakes it.",
    .tp_basicsize = sizeof(Waiter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Waiter_new,
    .tp_dealloc = (destructor)Waiter_dealloc,
    .tp_methods = Waiter_methods,
};

/* -- block, wake_now ----------------------------------------------------------------------- */

/* Take the waiters of ``wakes`` that are still to be released, emptying the list: each is
 * marked released and kept alive in held[] (stack or heap) until drop_taken().
 * Returns 0 when done; -1 when refused with nothing taken (error set); 1 when taken but the
 * list could not be emptied (error set: the caller still releases what it took). */
typedef struct {
    PyObject *stack[STACK_WAKES], **held;
    Py_ssize_t k;
} Taken;

static int take_wakes(PyObject *wakes, Taken *t, const char *who) {
    Py_ssize_t n = wakes == NULL ? 0 : PyList_GET_SIZE(wakes);
    t->held = t->stack;
    t->k = 0;
    if (n == 0)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* check everything before taking anything */
        if (!PyObject_TypeCheck(PyList_GET_ITEM(wakes, i), &WaiterType)) {
            PyErr_Format(PyExc_TypeError, "%s(): wakes must hold Waiter objects", who);
            return -1;
        }
    }
    if (n > STACK_WAKES && (t->held = PyMem_New(PyObject *, n)) == NULL) {
        t->held = t->stack;
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Waiter *w = (Waiter *)PyList_GET_ITEM(wakes, i);
        if (!w->released) {
            w->released = 1;
            Py_INCREF(w);  /* kept alive until its lock is released */
            t->held[t->k++] = (PyObject *)w;
        }
    }
    return PyList_SetSlice(wakes, 0, n, NULL) == 0 ? 0 : 1;
}

/* Without the GIL: wake every taken waiter. */
static void release_taken(Taken *t) {
    for (Py_ssize_t j = 0; j < t->k; j++)
        PyThread_release_lock(((Waiter *)t->held[j])->lock);
}

/* With the GIL: let go of the taken waiters. */
static void drop_taken(Taken *t) {
    for (Py_ssize_t j = 0; j < t->k; j++)
        Py_DECREF(t->held[j]);
    if (t->held != t->stack)
        PyMem_Free(t->held);
}

/* Release the waiters in ``wakes`` (a list or NULL) and wait on ``own`` up to ``timeout``
 * seconds (< 0: no limit), without the GIL in between. 1 when woken, 0 when timed out,
 * -1 with an error set (a bad list: nothing waited; or a signal handler raised). */
static int block_on(Waiter *own, PyObject *wakes, double timeout) {
    Taken t;
    int taken = take_wakes(wakes, &t, "block");
    if (taken < 0)
        return -1;
    int listed = taken == 0;  /* else: release what was taken, do not wait, raise */
    PyLockStatus got = PY_LOCK_FAILURE;
    PY_TIMEOUT_T micros = -1;
    long long deadline = 0;
    if (timeout >= 0) {
        micros = timeout * 1e6 >= (double)PY_TIMEOUT_MAX ? PY_TIMEOUT_MAX : (PY_TIMEOUT_T)(timeout * 1e6);
        deadline = monotonic_ns() + (long long)micros * 1000;
    }
    Py_INCREF(own);
    Py_BEGIN_ALLOW_THREADS
    release_taken(&t);
    if (listed)
        got = PyThread_acquire_lock_timed(own->lock, micros, 1);
    Py_END_ALLOW_THREADS
    /* Interrupted by a signal: run its handler (main thread), then wait for what is left. */
    while (listed && got == PY_LOCK_INTR) {
        if (PyErr_CheckSignals() < 0)
            break;
        if (micros > 0) {
            long long left = deadline - monotonic_ns();
            micros = left > 0 ? (PY_TIMEOUT_T)(left / 1000) : 0;
        }
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(own->lock, micros, 1);
        Py_END_ALLOW_THREADS
    }
    if (got == PY_LOCK_ACQUIRED)
        PyThread_release_lock(own->lock);  /* left unlocked: woken once, it stays woken */
    Py_DECREF(own);
    drop_taken(&t);
    if (PyErr_Occurred())
        return -1;
    return got == PY_LOCK_ACQUIRED;
}

static PyObject *block(PyObject *module, PyObject *args) {
    PyObject *waiter, *wakes;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!O!d:block", &WaiterType, &waiter, &PyList_Type, &wakes, &timeout))
        return NULL;
    int woken = block_on((Waiter *)waiter, wakes, timeout);
    return woken < 0 ? NULL : PyBool_FromLong(woken);
}

static PyObject *wake_now(PyObject *module, PyObject *wakes) {
    if (!PyList_Check(wakes)) {
        PyErr_SetString(PyExc_TypeError, "wake_now(): wakes must be a list");
        return NULL;
    }
    if (PyList_GET_SIZE(wakes) == 0)
        Py_RETURN_NONE;
    Taken t;
    int taken = take_wakes(wakes, &t, "wake_now");
    if (taken < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    release_taken(&t);
    Py_END_ALLOW_THREADS
    drop_taken(&t);
    if (taken != 0)
        return NULL;
    Py_RETURN_NONE;
}

/* With the GIL held: release every waiter in ``wakes`` and empty it (rings.wake_all). */
static int wake_all(PyObject *wakes) {
    Py_ssize_t n = PyList_GET_SIZE(wakes);
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(wakes, i);
        if (Py_IS_TYPE(w, &WaiterType)) {
            waiter_release((Waiter *)w);
        } else if (!failed) {
            PyObject *r = PyObject_CallMethod(w, "release", NULL);
            failed = r == NULL;
            Py_XDECREF(r);
        }
    }
    return PyList_SetSlice(wakes, 0, n, NULL) < 0 || failed ? -1 : 0;
}

/* ``deferred`` as passed from Python: None -> NULL (wake at once), else it must be a list. */
static int deferred_arg(PyObject **deferred) {
    if (*deferred == Py_None) {
        *deferred = NULL;
    } else if (*deferred != NULL && !PyList_Check(*deferred)) {
        PyErr_SetString(PyExc_TypeError, "deferred must be a list or None");
        return -1;
    }
    return 0;
}

/* -- Inbox ---------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    PyObject *rings;    /* list of Ring: every ring into this node */
    Py_ssize_t open;    /* rings not closed yet */
    PyObject *control;  /* list: the control lane, oldest first */
    Waiter *waiter;     /* the one the sleeping consumer blocks on, else NULL */
} Inbox;

typedef struct {
    PyObject_HEAD
    Inbox *inbox;
    PyObject *name, *policy;
    int kind;  /* BLOCK, DROP_OLDEST or DROP_NEWEST */
    Py_ssize_t capacity;
    PyObject **items;  /* circular: len items from head, in a buffer of alloc slots */
    double *times;     /* the put time of each item, side by side */
    Py_ssize_t head, len, alloc;
    PyObject *room;    /* list of Waiter: producers blocked until there is room */
    int closed;
    Py_ssize_t puts, drops, high_water;
    double blocked_s;
    PyObject *dict;    /* the scheduler notes a ring's destination port on it */
} Ring;

enum { BLOCK, DROP_OLDEST, DROP_NEWEST };
static const char *POLICIES[] = {"block", "drop_oldest", "drop_newest"};

static PyTypeObject InboxType, RingType;

/* Take the inbox lock; when another thread has it, wait for it without the GIL. */
static void lock_inbox(Inbox *ib) {
    if (!PyThread_acquire_lock(ib->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(ib->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
}

static void unlock_inbox(Inbox *ib) { PyThread_release_lock(ib->lock); }

/* With the lock held, after adding something the consumer may want: wake it if it sleeps,
 * or add its waiter to ``deferred`` for the caller to release just before it sleeps. */
static int inbox_wake(Inbox *ib, PyObject *deferred) {
    Waiter *w = ib->waiter;
    if (w == NULL)
        return 0;
    ib->waiter = NULL;
    int rc = 0;
    if (deferred == NULL || (rc = PyList_Append(deferred, (PyObject *)w)) < 0)
        waiter_release(w);  /* a wake that cannot be deferred is done now, never lost */
    Py_DECREF(w);
    return rc;
}

/* With the lock held: let it go until woken or timed out (after waking ``deferred``), then
 * take it again. 1 woken, 0 timed out, -1 error; the lock is held again in every case. */
static int inbox_sleep(Inbox *ib, double timeout, PyObject *deferred) {
    Waiter *w = waiter_create();
    if (w == NULL)
        return -1;
    Py_INCREF(w);
    Py_XSETREF(ib->waiter, w);
    unlock_inbox(ib);
    int woken = block_on(w, deferred, timeout);
    lock_inbox(ib);
    if (ib->waiter == w) {
        ib->waiter = NULL;
        Py_DECREF(w);
    }
    Py_DECREF(w);
    return woken;
}

/* With the lock held, after items left a ring: wake the producers waiting for room, or add
 * them to ``deferred``. */
static void room_made(PyObject *room, PyObject *deferred) {
    Py_ssize_t n = PyList_GET_SIZE(room);
    if (n == 0)
        return;
    if (deferred == NULL || PyList_SetSlice(deferred, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, room) < 0) {
        PyErr_Clear();  /* a wake that cannot be deferred is done now, never lost */
        for (Py_ssize_t i = 0; i < n; i++)
            waiter_release((Waiter *)PyList_GET_ITEM(room, i));
    }
    (void)PyList_SetSlice(room, 0, n, NULL);  /* shrinking a list does not fail */
}

static PyObject *Inbox_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Inbox() takes no arguments");
        return NULL;
    }
    Inbox *self = (Inbox *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    self->rings = PyList_New(0);
    self->control = PyList_New(0);
    if (self->lock == NULL || self->rings == NULL || self->control == NULL) {
        Py_DECREF(self);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int Inbox_traverse(Inbox *self, visitproc visit, void *arg) {
    Py_VISIT(self->rings);
    Py_VISIT(self->control);
    return 0;
}

static int Inbox_clear(Inbox *self) {
    Py_CLEAR(self->rings);
    Py_CLEAR(self->control);
    Py_CLEAR(self->waiter);
    return 0;
}

static void Inbox_dealloc(Inbox *self) {
    PyObject_GC_UnTrack(self);
    Inbox_clear(self);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Inbox_post_control(Inbox *self, PyObject *item) {
    lock_inbox(self);
    int rc = PyList_Append(self->control, item);
    if (rc == 0)
        inbox_wake(self, NULL);
    unlock_inbox(self);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* What wait() takes under the lock: control items and each ring's items with their put
 * times, as references in plain arrays. The lists it hands out are built after the lock is
 * let go, so that no collection (and no finalizer that might put into this inbox) runs
 * with the lock held. */
#define STACK_TAKE 32
typedef struct {
    PyObject *stack_items[STACK_TAKE], **items;  /* control items first, then ring items */
    double stack_times[STACK_TAKE], *times;
    Py_ssize_t ncontrol, total;
    Py_ssize_t stack_counts[STACK_TAKE], *counts; /* per ring of the inbox (0: nothing) */
    Py_ssize_t nrings;
} Take;

static void take_free(Take *t) {
    if (t->items != t->stack_items)
        PyMem_Free(t->items);
    if (t->times != t->stack_times)
        PyMem_Free(t->times);
    if (t->counts != t->stack_counts)
        PyMem_Free(t->counts);
}

/* With the lock held: move everything available into ``t``. -1 when out of memory (nothing
 * taken). */
static int take(Inbox *self, Take *t, Py_ssize_t total, PyObject *deferred) {
    Py_ssize_t ncontrol = PyList_GET_SIZE(self->control), nrings = PyList_GET_SIZE(self->rings);
    t->items = t->stack_items;
    t->times = t->stack_times;
    t->counts = t->stack_counts;
    if (ncontrol + total > STACK_TAKE) {
        t->items = PyMem_New(PyObject *, ncontrol + total);
        t->times = PyMem_New(double, total);
    }
    if (nrings > STACK_TAKE)
        t->counts = PyMem_New(Py_ssize_t, nrings);
    if (t->items == NULL || t->times == NULL || t->counts == NULL) {
        take_free(t);
        return -1;
    }
    t->ncontrol = ncontrol;
    t->total = total;
    t->nrings = nrings;
    for (Py_ssize_t i = 0; i < ncontrol; i++)
        t->items[i] = Py_NewRef(PyList_GET_ITEM(self->control, i));
    (void)PyList_SetSlice(self->control, 0, ncontrol, NULL);
    PyObject **items = t->items + ncontrol;
    double *times = t->times;
    for (Py_ssize_t i = 0; i < nrings; i++) {
        Ring *r = (Ring *)PyList_GET_ITEM(self->rings, i);
        if ((t->counts[i] = r->len) == 0)
            continue;
        for (Py_ssize_t j = 0, at = r->head; j < r->len; j++) {
            *items++ = r->items[at];  /* the ring's reference moves out with the item */
            *times++ = r->times[at];
            if (++at == r->alloc)
                at = 0;
        }
        r->head = r->len = 0;
        room_made(r->room, deferred);
    }
    return 0;
}

/* After the lock: (control, data, False) from what take() moved out. */
static PyObject *hand_out(Inbox *self, Take *t) {
    PyObject *control = PyList_New(t->ncontrol), *data = PyList_New(0), *result = NULL;
    PyObject **items = t->items;  /* a slot is NULL once its reference has moved to a list */
    for (Py_ssize_t j = 0; control != NULL && j < t->ncontrol; j++) {
        PyList_SET_ITEM(control, j, items[j]);
        items[j] = NULL;
    }
    for (Py_ssize_t i = 0, k = 0; i < t->nrings && data != NULL; k += t->counts[i++]) {
        Py_ssize_t n = t->counts[i];
        if (n == 0)
            continue;
        PyObject *list = PyList_New(n), *put = PyList_New(n), *entry = NULL;
        if (list != NULL && put != NULL) {
            Py_ssize_t j = 0;
            for (; j < n; j++) {
                PyList_SET_ITEM(list, j, items[t->ncontrol + k + j]);
                items[t->ncontrol + k + j] = NULL;
            }
            for (j = 0; j < n; j++) {
                PyObject *f = PyFloat_FromDouble(t->times[k + j]);
                if (f == NULL)
                    break;
                PyList_SET_ITEM(put, j, f);
            }
            /* rings is only ever appended to: index i is still the ring counted */
            if (j == n)
                entry = PyTuple_Pack(3, PyList_GET_ITEM(self->rings, i), list, put);
        }
        Py_XDECREF(list);
        Py_XDECREF(put);
        if (entry == NULL || PyList_Append(data, entry) < 0)
            Py_CLEAR(data);
        Py_XDECREF(entry);
    }
    for (Py_ssize_t j = 0; j < t->ncontrol + t->total; j++)  /* out of memory: the rest is lost */
        Py_XDECREF(items[j]);
    if (control != NULL && data != NULL)
        result = PyTuple_Pack(3, control, data, Py_False);
    Py_XDECREF(control);
    Py_XDECREF(data);
    take_free(t);
    return result;
}

static PyObject *Inbox_wait(Inbox *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"timeout", "deferred", NULL};
    PyObject *timeout_arg = Py_None, *deferred = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:wait", kwlist, &timeout_arg, &deferred)
        || deferred_arg(&deferred) < 0)
        return NULL;
    double timeout = -1.0;
    if (timeout_arg != Py_None) {
        timeout = PyFloat_AsDouble(timeout_arg);
        if (timeout == -1.0 && PyErr_Occurred())
            return NULL;
        if (timeout < 0)
            timeout = 0;
    }
    PyObject *result = NULL;
    Py_ssize_t total;
    lock_inbox(self);
    for (;;) {
        total = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->rings); i++)
            total += ((Ring *)PyList_GET_ITEM(self->rings, i))->len;
        if (total || PyList_GET_SIZE(self->control))
            break;
        if (self->open == 0) {
            unlock_inbox(self);
            result = Py_BuildValue("([][]O)", Py_True);
            goto done;
        }
        int woken = inbox_sleep(self, timeout, deferred);  /* does the deferred wakes */
        if (woken < 0) {
            unlock_inbox(self);
            return NULL;
        }
        if (!woken)
            break;  /* timed out: hand out what there is, maybe nothing */
    }
    Take t;
    int took = take(self, &t, total, deferred);
    unlock_inbox(self);
    result = took < 0 ? PyErr_NoMemory() : hand_out(self, &t);
done:
    if (deferred != NULL && PyList_GET_SIZE(deferred) && wake_all(deferred) < 0)
        Py_CLEAR(result);
    return result;
}

static PyObject *Inbox_get_waiter(Inbox *self, void *closure) {
    return Py_NewRef(self->waiter != NULL ? (PyObject *)self->waiter : Py_None);
}

static PyMethodDef Inbox_methods[] = {
    {"post_control", (PyCFunction)Inbox_post_control, METH_O,
     "Control never waits behind data: it has its own unbounded lane (rare items)."},
    {"wait", (PyCFunction)(void (*)(void))Inbox_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None, deferred=None) -> (control, data, all_inputs_done): block until there is\n"
     "control or data; data is [(ring, items, put_times)], ring by ring, each in FIFO order.\n"
     "The deferred wakes are done before this returns or sleeps."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Inbox_get_rings(Inbox *self, void *closure) {
    return PyList_GetSlice(self->rings, 0, PY_SSIZE_T_MAX);  /* a copy: the C code relies on its own */
}

static PyMemberDef Inbox_members[] = {
    {"open", T_PYSSIZET, offsetof(Inbox, open), READONLY, "rings not closed yet"},
    {NULL},
};

static PyGetSetDef Inbox_getset[] = {
    {"rings", (getter)Inbox_get_rings, NULL, "every ring into this node (a copy)", NULL},
    {"_waiter", (getter)Inbox_get_waiter, NULL, "the Waiter the sleeping consumer blocks on, else None", NULL},
    {NULL},
};

static PyTypeObject InboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "s2s_flow._rings.Inbox",
    .tp_doc = "Inbox(): the consumer side shared by every ring into one node, plus its control lane.",
    .tp_basicsize = sizeof(Inbox),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Inbox_new,
    .tp_dealloc = (destructor)Inbox_dealloc,
    .tp_traverse = (traverseproc)Inbox_traverse,
    .tp_clear = (inquiry)Inbox_clear,
    .tp_methods = Inbox_methods,
    .tp_members = Inbox_members,
    .tp_getset = Inbox_getset,
};

/* -- Ring ----------------------------------------------------------------------------------- */

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"capacity", "policy", "inbox", "name", NULL};
    PyObject *capacity, *policy = NULL, *inbox = Py_None, *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O$OU:Ring", kwlist, &capacity, &policy, &inbox, &name))
        return NULL;
    Ring *self = (Ring *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->name = name != NULL ? Py_NewRef(name) : PyUnicode_FromString("");
    self->policy = policy != NULL ? Py_NewRef(policy) : PyUnicode_FromString("block");
    self->room = PyList_New(0);
    if (self->name == NULL || self->policy == NULL || self->room == NULL)
        goto fail;
    self->capacity = PyNumber_AsSsize_t(capacity, PyExc_OverflowError);
    if (self->capacity == -1 && PyErr_Occurred())
        goto fail;
    if (self->capacity < 1) {
        PyErr_Format(PyExc_ValueError, "ring %R: capacity must be >= 1, got %R", self->name, capacity);
        goto fail;
    }
    self->kind = -1;
    for (int i = 0; i < 3 && PyUnicode_Check(self->policy); i++)
        if (PyUnicode_CompareWithASCIIString(self->policy, POLICIES[i]) == 0)
            self->kind = i;
    if (self->kind < 0) {
        PyErr_Format(PyExc_ValueError, "ring %R: policy must be one of block, drop_oldest, drop_newest, got %R",
                     self->name, self->policy);
        goto fail;
    }
    if (inbox == Py_None) {
        inbox = PyObject_CallNoArgs((PyObject *)&InboxType);
        if (inbox == NULL)
            goto fail;
    } else if (Py_IS_TYPE(inbox, &InboxType)) {
        Py_INCREF(inbox);
    } else {
        PyErr_Format(PyExc_TypeError, "ring %R: inbox must be an s2s_flow._rings.Inbox, got %.100s",
                     self->name, Py_TYPE(inbox)->tp_name);
        goto fail;
    }
    self->inbox = (Inbox *)inbox;
    lock_inbox(self->inbox);
    int rc = PyList_Append(self->inbox->rings, (PyObject *)self);
    if (rc == 0)
        self->inbox->open++;
    unlock_inbox(self->inbox);
    if (rc < 0)
        goto fail;
    return (PyObject *)self;

fail:
    Py_DECREF(self);
    return NULL;
}

static int Ring_traverse(Ring *self, visitproc visit, void *arg) {
    Py_VISIT(self->inbox);
    Py_VISIT(self->room);
    Py_VISIT(self->dict);
    for (Py_ssize_t j = 0, at = self->head; j < self->len; j++) {
        Py_VISIT(self->items[at]);
        if (++at == self->alloc)
            at = 0;
    }
    return 0;
}

/* Move every item out of the ring (with the lock held, or when no other thread can see it)
 * into a PyMem array for the caller to let go of: NULL with *n == 0 when it is empty; NULL
 * with *n > 0 when there is no memory for the array (nothing moved, no error set). */
static PyObject **take_all(Ring *self, Py_ssize_t *n) {
    *n = self->len;
    if (self->len == 0)
        return NULL;
    PyObject **out = PyMem_New(PyObject *, self->len);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0, at = self->head; j < self->len; j++) {
        out[j] = self->items[at];
        if (++at == self->alloc)
            at = 0;
    }
    self->head = self->len = 0;
    return out;
}

static void let_go(PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++)
        Py_DECREF(items[j]);
    PyMem_Free(items);
}

/* The inbox and the room list (waiters only) stay until dealloc: clearing the inbox's list
 * of rings breaks that cycle, and so every method can count on both. */
static int Ring_clear(Ring *self) {
    Py_ssize_t n;
    PyObject **items = take_all(self, &n);
    if (items != NULL)
        let_go(items, n);
    Py_CLEAR(self->dict);
    return 0;
}

static void Ring_dealloc(Ring *self) {
    PyObject_GC_UnTrack(self);
    Ring_clear(self);
    Py_CLEAR(self->inbox);
    Py_CLEAR(self->room);
    for (Py_ssize_t j = 0, at = self->head; j < self->len; j++) {  /* take_all() had no memory */
        Py_DECREF(self->items[at]);
        if (++at == self->alloc)
            at = 0;
    }
    PyMem_Free(self->items);
    PyMem_Free(self->times);
    Py_XDECREF(self->name);
    Py_XDECREF(self->policy);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* With the lock held and the ring not full: append one item, with its put time. */
static int push(Ring *r, PyObject *item, double now) {
    if (r->len == r->alloc) {  /* grow by doubling, up to the capacity: a ring never used is small */
        Py_ssize_t alloc = r->alloc ? r->alloc * 2 : 8;
        if (alloc > r->capacity)
            alloc = r->capacity;
        PyObject **items = PyMem_New(PyObject *, alloc);
        double *times = PyMem_New(double, alloc);
        if (items == NULL || times == NULL) {
            PyMem_Free(items);
            PyMem_Free(times);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t j = 0, at = r->head; j < r->len; j++) {
            items[j] = r->items[at];
            times[j] = r->times[at];
            if (++at == r->alloc)
                at = 0;
        }
        PyMem_Free(r->items);
        PyMem_Free(r->times);
        r->items = items;
        r->times = times;
        r->alloc = alloc;
        r->head = 0;
    }
    Py_ssize_t at = r->head + r->len;
    if (at >= r->alloc)
        at -= r->alloc;
    r->items[at] = Py_NewRef(item);
    r->times[at] = now;
    r->len++;
    r->puts++;
    if (r->len > r->high_water)
        r->high_water = r->len;
    return 0;
}

/* With the lock held: take the oldest item out (the caller lets go of it after unlocking). */
static PyObject *pop_oldest(Ring *r) {
    PyObject *item = r->items[r->head];
    if (++r->head == r->alloc)
        r->head = 0;
    r->len--;
    return item;
}

/* With the lock held and the ring full: wait until it has room or is closed, counting the
 * time. The deferred wakes are done as this thread blocks: never block with a consumer
 * unwoken. 0, or -1 with an error set. */
static int wait_for_room(Ring *r, PyObject *deferred) {
    double t0 = monotonic();
    int rc = 0;
    while (r->len >= r->capacity && !r->closed) {
        Waiter *w = waiter_create();
        if (w == NULL || PyList_Append(r->room, (PyObject *)w) < 0) {
            Py_XDECREF(w);
            rc = -1;
            break;
        }
        unlock_inbox(r->inbox);
        int woken = block_on(w, deferred, -1.0);
        Py_DECREF(w);
        lock_inbox(r->inbox);
        if (woken < 0) {
            rc = -1;
            break;
        }
    }
    r->blocked_s += monotonic() - t0;
    return rc;
}

/* put(): 1 kept, 0 when the policy dropped something (this item or the oldest), -1 error. */
static int ring_put(Ring *r, PyObject *item, PyObject *deferred) {
    Inbox *ib = r->inbox;
    PyObject *dropped = NULL;
    int kept = 1, rc = 0;
    lock_inbox(ib);
    if (!r->closed && r->len >= r->capacity) {
        if (r->kind == BLOCK) {
            rc = wait_for_room(r, deferred);
        } else if (r->kind == DROP_NEWEST) {
            r->drops++;
            unlock_inbox(ib);
            return 0;
        } else {
            r->drops++;
            dropped = pop_oldest(r);
            kept = 0;
        }
    }
    if (rc == 0 && r->closed)
        rc = 1;
    if (rc == 0) {
        rc = push(r, item, monotonic());
        if (rc == 0 && ib->waiter != NULL)
            rc = inbox_wake(ib, deferred);
    }
    unlock_inbox(ib);
    Py_XDECREF(dropped);
    if (rc == 1) {
        PyErr_SetObject(RingClosed, r->name);
        return -1;
    }
    return rc < 0 ? -1 : kept;
}

static int put_args(const char *who, Py_ssize_t nargs, PyObject *const *args, PyObject **deferred) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 1 or 2 arguments (%zd given)", who, nargs);
        return -1;
    }
    *deferred = nargs > 1 ? args[1] : Py_None;
    return deferred_arg(deferred);
}

static PyObject *Ring_put(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *deferred;
    if (put_args("put", nargs, args, &deferred) < 0)
        return NULL;
    int kept = ring_put(self, args[0], deferred);
    return kept < 0 ? NULL : PyBool_FromLong(kept);
}

static PyObject *Ring_put_many(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *deferred;
    if (put_args("put_many", nargs, args, &deferred) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "put_many() takes a sequence of items");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int rc = 0;
    if (self->kind != BLOCK) {
        for (; i < n && rc >= 0; i++)
            rc = ring_put(self, items[i], deferred);
    }
    Inbox *ib = self->inbox;
    while (i < n && rc >= 0) {  /* block: one lock per run of items that fits */
        lock_inbox(ib);
        if (self->len >= self->capacity && !self->closed)
            rc = wait_for_room(self, deferred);
        if (rc == 0 && self->closed) {
            unlock_inbox(ib);
            PyErr_SetObject(RingClosed, self->name);
            rc = -1;
            break;
        }
        double now = monotonic();
        for (; rc == 0 && i < n && self->len < self->capacity; i++)
            rc = push(self, items[i], now);
        if (rc == 0 && ib->waiter != NULL)
            rc = inbox_wake(ib, deferred);
        unlock_inbox(ib);
    }
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_get(Ring *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_arg = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:get", kwlist, &timeout_arg))
        return NULL;
    int timed = timeout_arg != Py_None;
    double deadline = 0;
    if (timed) {
        double timeout = PyFloat_AsDouble(timeout_arg);
        if (timeout == -1.0 && PyErr_Occurred())
            return NULL;
        deadline = monotonic() + timeout;
    }
    Inbox *ib = self->inbox;
    lock_inbox(ib);
    while (self->len == 0) {
        PyObject *error = self->closed ? RingClosed : NULL;
        double remaining = timed ? deadline - monotonic() : -1.0;
        if (error == NULL && timed && remaining <= 0)
            error = PyExc_TimeoutError;
        if (error != NULL) {
            unlock_inbox(ib);
            PyErr_SetObject(error, self->name);
            return NULL;
        }
        if (inbox_sleep(ib, remaining, NULL) < 0) {
            unlock_inbox(ib);
            return NULL;
        }
    }
    PyObject *item = pop_oldest(self);
    room_made(self->room, NULL);
    unlock_inbox(ib);
    return item;
}

static PyObject *Ring_flush(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "flush() takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    PyObject *stale = nargs ? args[0] : Py_None;
    Inbox *ib = self->inbox;
    lock_inbox(ib);
    Py_ssize_t n = self->len, dropped = 0, kept = 0;
    char *drop = PyMem_Malloc(n ? n : 1);
    PyObject **gone = PyMem_New(PyObject *, n ? n : 1);
    if (drop == NULL || gone == NULL) {
        unlock_inbox(ib);
        PyMem_Free(drop);
        PyMem_Free(gone);
        return PyErr_NoMemory();
    }
    /* Ask about every item first, with the lock held (as rings.py does): an error leaves the
     * ring as it was. */
    for (Py_ssize_t j = 0, at = self->head; j < n; j++) {
        int is_stale = 1;
        if (stale != Py_None) {
            PyObject *answer = PyObject_CallOneArg(stale, self->items[at]);
            is_stale = answer == NULL ? -1 : PyObject_IsTrue(answer);
            Py_XDECREF(answer);
        }
        if (is_stale < 0) {
            unlock_inbox(ib);
            PyMem_Free(drop);
            PyMem_Free(gone);
            return NULL;
        }
        drop[j] = (char)is_stale;
        if (++at == self->alloc)
            at = 0;
    }
    for (Py_ssize_t j = 0, at = self->head, to = self->head; j < n; j++) {  /* keep in order */
        if (drop[j]) {
            gone[dropped++] = self->items[at];
        } else {
            self->items[to] = self->items[at];
            self->times[to] = self->times[at];
            kept++;
            if (++to == self->alloc)
                to = 0;
        }
        if (++at == self->alloc)
            at = 0;
    }
    self->len = kept;
    self->drops += dropped;
    if (dropped)
        room_made(self->room, NULL);
    unlock_inbox(ib);
    PyMem_Free(drop);
    let_go(gone, dropped);
    return PyLong_FromSsize_t(dropped);
}

static PyObject *Ring_close(Ring *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"discard", NULL};
    int discard = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$p:close", kwlist, &discard))
        return NULL;
    Inbox *ib = self->inbox;
    Py_ssize_t n = 0;
    PyObject **gone = NULL;
    lock_inbox(ib);
    if (!self->closed) {
        self->closed = 1;
        ib->open--;
    }
    if (discard) {
        gone = take_all(self, &n);  /* no memory: the items stay, for the consumer to drain */
        if (gone != NULL)
            self->drops += n;
    }
    room_made(self->room, NULL);
    inbox_wake(ib, NULL);
    unlock_inbox(ib);
    if (gone != NULL)
        let_go(gone, n);
    Py_RETURN_NONE;
}

static PyObject *Ring_stats(Ring *self, PyObject *unused) {
    if (RingStats == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "s2s_flow._rings: setup() was not called");
        return NULL;
    }
    lock_inbox(self->inbox);
    Py_ssize_t puts = self->puts, drops = self->drops, high_water = self->high_water;
    double blocked_s = self->blocked_s;
    unlock_inbox(self->inbox);
    PyObject *blocked = PyFloat_FromDouble(blocked_s), *rounded = NULL, *stats = NULL;
    if (blocked != NULL)
        rounded = PyObject_CallMethod(blocked, "__round__", "i", 6);
    if (rounded != NULL)
        stats = PyObject_CallFunction(RingStats, "OnOnnnO", self->name, self->capacity, self->policy, puts, drops,
                                      high_water, rounded);
    Py_XDECREF(blocked);
    Py_XDECREF(rounded);
    return stats;
}

static PyObject *Ring_get_closed(Ring *self, void *closure) { return PyBool_FromLong(self->closed); }

static PyObject *Ring_get_room(Ring *self, void *closure) { return Py_NewRef(self->room); }

static Py_ssize_t Ring_len(Ring *self) { return self->len; }

static PyMethodDef Ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL,
     "put(item, deferred=None) -> bool: add an item; False when the policy dropped something (this\n"
     "or the oldest). With deferred (a list), the consumer's wake-up is added to it, not done now."},
    {"put_many", (PyCFunction)(void (*)(void))Ring_put_many, METH_FASTCALL,
     "put_many(items, deferred=None): put several items, taking the lock once per run that fits."},
    {"get", (PyCFunction)(void (*)(void))Ring_get, METH_VARARGS | METH_KEYWORDS,
     "get(timeout=None): take the oldest item, waiting up to timeout; RingClosed once closed and empty."},
    {"flush", (PyCFunction)(void (*)(void))Ring_flush, METH_FASTCALL,
     "flush(stale=None) -> int: drop every item (or those stale(item) says are stale); how many."},
    {"close", (PyCFunction)(void (*)(void))Ring_close, METH_VARARGS | METH_KEYWORDS,
     "close(*, discard=False): no more puts; the consumer still drains what is queued, unless discard."},
    {"stats", (PyCFunction)Ring_stats, METH_NOARGS, "stats() -> RingStats"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ring_members[] = {
    {"name", T_OBJECT, offsetof(Ring, name), READONLY, NULL},
    {"capacity", T_PYSSIZET, offsetof(Ring, capacity), READONLY, NULL},
    {"policy", T_OBJECT, offsetof(Ring, policy), READONLY, NULL},
    {"inbox", T_OBJECT, offsetof(Ring, inbox), READONLY, NULL},
    {"puts", T_PYSSIZET, offsetof(Ring, puts), READONLY, NULL},
    {"drops", T_PYSSIZET, offsetof(Ring, drops), READONLY, NULL},
    {"high_water", T_PYSSIZET, offsetof(Ring, high_water), READONLY, NULL},
    {"blocked_s", T_DOUBLE, offsetof(Ring, blocked_s), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"closed", (getter)Ring_get_closed, NULL, NULL, NULL},
    {"_room", (getter)Ring_get_room, NULL, "the waiters of producers blocked until there is room", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PySequenceMethods Ring_as_sequence = {.sq_length = (lenfunc)Ring_len};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "s2s_flow._rings.Ring",
    .tp_doc = "Ring(capacity, policy='block', *, inbox=None, name=''): a bounded FIFO from one producer\n"
              "port to one consumer port.",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Ring_new,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_traverse = (traverseproc)Ring_traverse,
    .tp_clear = (inquiry)Ring_clear,
    .tp_methods = Ring_methods,
    .tp_members = Ring_members,
    .tp_getset = Ring_getset,
    .tp_as_sequence = &Ring_as_sequence,
    .tp_dictoffset = offsetof(Ring, dict),
};

/* -- module --------------------------------------------------------------------------------- */

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *stats, *closed;
    if (!PyArg_ParseTuple(args, "OO!:setup", &stats, &PyType_Type, &closed))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)closed, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "setup(): RingClosed must be an exception class");
        return NULL;
    }
    Py_XSETREF(RingStats, Py_NewRef(stats));
    Py_XSETREF(RingClosed, Py_NewRef(closed));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"block", block, METH_VARARGS,
     "block(waiter, wakes, timeout) -> bool: without the GIL, release the waiters in wakes (emptying\n"
     "the list), then wait on waiter up to timeout seconds (< 0: no limit); True when woken."},
    {"wake_now", wake_now, METH_O,
     "wake_now(wakes): release the waiters in wakes (emptying the list) with the GIL let go for the\n"
     "moment, so that a woken thread that runs at once finds it free."},
    {"setup", setup, METH_VARARGS, "setup(RingStats, RingClosed): what stats() returns and a closed ring raises."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "s2s_flow._rings", "The rings in C (see s2s_flow/rings.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__rings(void) {
    PyTypeObject *types[] = {&WaiterType, &InboxType, &RingType};
    const char *names[] = {"Waiter", "Inbox", "Ring"};
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    for (int i = 0; i < 3; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
